"""What the tests share: the Hub server (``hub_server``), the engine workers run in the vLLM and
SGLang environments (``sglang_worker``, ``sglang_plugin_worker``, ``vllm_generate``), and one set
of helpers (``helpers``). Imported as ``support.<module>`` (pyproject puts tests/ on the path)."""
