"""The tables of the ``server_load`` benchmark, from its saved measurements (driver side only:
the servers' interpreters that run server_load.py never import this)."""

from __future__ import annotations

import statistics


def gb(n: float) -> str:
    return f"{n / 1e9:.3f}"


def med(values: list[float]) -> float:
    return statistics.median(values)


def span(values: list[float], fmt: str = "{:.1f}") -> str:
    return fmt.format(med(values)) + (
        f" ({fmt.format(min(values))}–{fmt.format(max(values))})" if len(values) > 1 else ""
    )


def report_vllm(pp: int, results: dict) -> None:
    runs, ckpt_bytes = results["vllm"], results["meta"]["checkpoint_bytes"]
    print(f"\n### vLLM, pp={pp}\n")
    n_run, n_alone = len(runs[f"{pp}/stock/run"]), len(runs[f"{pp}/stock/alone"])
    print(f"Medians of {n_run} starts as run; bytes read alone from {n_alone} start(s), loads serialised.\n")
    print(
        "| loader | worker | checkpoint bytes read, worker alone (GB, % of checkpoint) "
        "| read_bytes alone (GB) "
        "| read_bytes as run (GB) | engine start → weights loaded (s) | load_model (s) "
        "| load_model alone (s) "
        "| peak RSS, VmHWM (GB) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    stats = {}
    for method in ("stock", "split"):
        shared, alone = runs[f"{pp}/{method}/run"], runs[f"{pp}/{method}/alone"]
        for rank in range(pp):

            def col(rs, key, rank=rank):
                return [r["workers"][rank][key] for r in rs]

            s = {
                "resident": col(alone, "resident"),
                "alone_read_bytes": col(alone, "read_bytes"),
                "alone_load_s": col(alone, "load_s"),
                "read_bytes": col(shared, "read_bytes"),
                "since_start": col(shared, "since_start"),
                "load_s": col(shared, "load_s"),
                "peak_rss": col(shared, "peak_rss"),
            }
            stats[(method, rank)] = s
            name = "stock (whole checkpoint)" if method == "stock" else "qwen35-stages (split)"
            res = med(s["resident"])
            print(
                f"| {name} | PP{rank} | {gb(res)} ({100 * res / ckpt_bytes:.1f}%) "
                f"| {gb(med(s['alone_read_bytes']))} "
                f"| {gb(med(s['read_bytes']))} | {span(s['since_start'])} | {span(s['load_s'], '{:.2f}')} "
                f"| {span(s['alone_load_s'], '{:.2f}')} | {gb(med(s['peak_rss']))} |"
            )
    for method in ("stock", "split"):
        rs = runs[f"{pp}/{method}/run"]
        union = med([r["union"] for r in rs])
        total_rb = med([sum(w["read_bytes"] for w in r["workers"]) for r in rs])
        print(
            f"\n{method}, as run: its files (whole checkpoint / every stage) in the page cache after "
            f"the load {gb(union)} GB "
            f"({100 * union / ckpt_bytes:.1f}%), read_bytes summed over the workers {gb(total_rb)} GB."
        )
    stage_bytes = results["meta"]["stage_bytes"][f"vllm/{pp}"]
    stages = ", ".join(gb(b) for b in stage_bytes)
    print(f"\nCheckpoint files {gb(ckpt_bytes)} GB; the stages' files {stages} GB.\n")
    print(
        "| worker | bytes read, split / stock | start → loaded, split / stock | load_model, split / stock "
        "| load_model alone, split / stock | peak RSS, split / stock |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for rank in range(pp):
        a, b = stats[("stock", rank)], stats[("split", rank)]
        print(
            f"| PP{rank} | {med(b['resident']) / med(a['resident']):.3f} | "
            f"{med(b['since_start']) / med(a['since_start']):.2f} | "
            f"{med(b['load_s']) / med(a['load_s']):.2f} | "
            f"{med(b['alone_load_s']) / med(a['alone_load_s']):.2f} | "
            f"{med(b['peak_rss']) / med(a['peak_rss']):.2f} |"
        )


def report_sglang(pp: int, results: dict) -> None:
    runs, ckpt_bytes = results["sglang"], results["meta"]["checkpoint_bytes"]
    n = len(runs[f"{pp}/stock/0"])
    print(
        f"\n### SGLang, pp={pp} (DefaultModelLoader.load_model, one rank per process, alone; {n} round(s))\n"
    )
    print(
        "| model path | rank | layers | checkpoint bytes read (GB, % of checkpoint) | read_bytes (GB) "
        "| process start → loaded (s) | load_model (s) | peak RSS, VmHWM (GB) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for method in ("stock", "split"):
        for rank in range(pp):
            rs = runs[f"{pp}/{method}/{rank}"]
            res = med([r["resident"] for r in rs])
            where = "MODEL (whole)" if method == "stock" else f"OUT/pp{rank}"
            print(
                f"| {where} | {rank} | {rs[0]['layers'][0]}–{rs[0]['layers'][1] - 1} | {gb(res)} "
                f"({100 * res / ckpt_bytes:.1f}%) | {gb(med([r['read_bytes'] for r in rs]))} "
                f"| {span([r['since_start'] for r in rs])} | {span([r['load_s'] for r in rs], '{:.2f}')} "
                f"| {gb(med([r['peak_rss'] for r in rs]))} |"
            )
    print("\n| rank | bytes read, stage / whole | load_model, stage / whole | peak RSS, stage / whole |")
    print("|---|---:|---:|---:|")
    for rank in range(pp):
        a, b = runs[f"{pp}/stock/{rank}"], runs[f"{pp}/split/{rank}"]

        def ratio(key, a=a, b=b):
            return med([r[key] for r in b]) / med([r[key] for r in a])

        print(f"| {rank} | {ratio('resident'):.3f} | {ratio('load_s'):.2f} | {ratio('peak_rss'):.2f} |")


def report(results: dict) -> None:
    meta = results["meta"]
    print(f"## Loading in the servers, {meta['stamp']}, {meta['host']}\n")
    print(
        f"Checkpoint: {gb(meta['checkpoint_bytes'])} GB in {meta['files']} files, {meta['kwargs']}; "
        f"{meta['rounds']} interleaved rounds asked for; page cache before every start: {meta['cache']}."
    )
    for server, rep, keys in (
        ("vllm", report_vllm, ("stock/run", "stock/alone", "split/run", "split/alone")),
        ("sglang", report_sglang, ("stock/0", "split/0")),
    ):
        for pp in meta["pp"] if server in meta["servers"] else ():
            if all(f"{pp}/{k}" in results[server] for k in keys):
                rep(pp, results)
            else:
                print(f"\n### {server}, pp={pp}: not measured (the run stopped before it)")
    if "seconds" in meta:
        print(f"\nWhole run: {meta['seconds']:.0f} s.")
