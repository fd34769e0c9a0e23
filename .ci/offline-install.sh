#!/usr/bin/env bash
# Offline install (docs/install.md): build a wheelhouse of the tool and its dependencies, then
# install from it alone into a fresh venv (--no-index: no package index) and run the tool.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip wheel -q --wheel-dir "$work/wheelhouse" .
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --no-index --find-links "$work/wheelhouse" qwen35-reshard
"$work/venv/bin/qwen35-reshard" --version
"$work/venv/bin/python" examples/tiny_checkpoint.py "$work/model" >/dev/null
"$work/venv/bin/qwen35-reshard" --pp 2 "$work/model" "$work/out" >/dev/null
"$work/venv/bin/qwen35-reshard" verify "$work/out" --source "$work/model"
echo "offline install OK"
