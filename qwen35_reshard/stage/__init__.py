"""Reading a stage directory: ``reader`` (check it against its manifest, without hashing),
``manifest`` (the stage manifest parsed into plain data) and ``findings`` (what is wrong, as data).

Below the writer, ``verify`` and the loader, which all read stages through it.
"""
