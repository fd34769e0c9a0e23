"""The model and its servers as data: tensor names and roles (``names``), the tensors a config
requires (``schema``), and each runtime's split and placement rules (``runtimes``)."""
