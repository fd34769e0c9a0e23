"""Draw the docs' pictures as static SVG (no JavaScript, no network): the payoff (bytes each
pipeline worker reads), a split of the example checkpoint (which tensors go to which stage)
and its stage sizes, from the tool's own plan. Run: ``python docs/tools/gen_figures.py``."""

from __future__ import annotations

import sys
import tempfile
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMG = ROOT / "docs" / "img"
COLORS = {"layers": "#4c78a8", "embed": "#f58518", "norm": "#54a24b", "lm_head": "#e45756",
          "mtp": "#b279a2", "visual": "#9d755d"}  # fmt: skip


def _svg(width: int, height: int, body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="13">\n<rect width="100%" height="100%" fill="white"/>\n'
        + "\n".join(body)
        + "\n</svg>\n"
    )


def _text(x: float, y: float, s: str, **attrs: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{x:.0f}" y="{y:.0f}"{extra}>{escape(s)}</text>'


def payoff() -> str:
    """Per worker, share of the checkpoint read while loading (docs/performance.md, issue 25)."""
    rows = [("vLLM, stock loader", 100, 100), ("vLLM, its stage", 49.7, 26.8),
            ("SGLang, stock loader", 100, 100), ("SGLang, its stage", 51.2, 26.7)]  # fmt: skip
    title = "Share of the checkpoint each pipeline worker reads (at most, measured)"
    body = [_text(10, 20, title, font_weight="bold")]
    for i, (label, pp2, pp4) in enumerate(rows):
        y = 40 + i * 44
        body.append(_text(10, y + 22, label))
        for j, (pp, share) in enumerate(((2, pp2), (4, pp4))):
            color = "#bbbbbb" if "stock" in label else "#4c78a8"
            bar = f'<rect x="190" y="{y + j * 18}" width="{share * 3:.0f}" height="15" fill="{color}"/>'
            body.append(bar)
            body.append(_text(195 + share * 3, y + j * 18 + 12, f"pp={pp}: {share:g}%"))
    return _svg(620, 40 + len(rows) * 44 + 10, body)


def _plan():  # noqa: ANN202 - the library's Plan
    sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
    import tiny_checkpoint

    from qwen35_reshard import reshard

    model = tiny_checkpoint.build_checkpoint(Path(tempfile.mkdtemp()) / "model")
    return reshard(model, None, pp=4, dry_run=True).plan


def _role(name: str) -> str:
    for key in ("visual", "mtp", "embed_tokens", "lm_head"):
        if key in name:
            return {"embed_tokens": "embed"}.get(key, key)
    return "layers" if ".layers." in name else "norm"


def split_diagram(plan) -> str:  # noqa: ANN001
    """Source shards on the left, stages on the right; a band per (shard, stage, role)."""
    title = f"{plan.checkpoint.num_layers} layers, 4 shards -> pp=4 (sglang): which tensors go where"
    body = [_text(10, 20, title, font_weight="bold")]
    shards = sorted(plan.checkpoint.files)
    for i, shard in enumerate(shards):
        body.append(f'<rect x="10" y="{40 + i * 60}" width="210" height="50" fill="#eeeeee" stroke="#999"/>')
        body.append(_text(18, 70 + i * 60, shard.replace(".safetensors", "")))
    for r, stage in enumerate(plan.stages):
        y = 40 + r * 60
        body.append(f'<rect x="480" y="{y}" width="200" height="50" fill="#eeeeee" stroke="#999"/>')
        body.append(_text(488, y + 20, f"{stage.dirname}: layers {stage.start_layer}-{stage.end_layer - 1}"))
        roles = sorted({_role(t.source.name) for f in stage.files for t in f.tensors} - {"layers"})
        body.append(_text(488, y + 40, "+ " + ", ".join(roles) if roles else "", font_size="10"))
        for i, shard in enumerate(shards):
            kinds = {_role(t.source.name) for f in stage.files for t in f.tensors if t.source.file == shard}
            for k, kind in enumerate(sorted(kinds)):
                y0, y1 = 45 + i * 60 + k * 6, y + 5 + k * 6
                body.append(f'<path d="M220 {y0} C350 {y0} 350 {y1} 480 {y1}" stroke="{COLORS[kind]}" '
                            'stroke-width="3" fill="none" opacity="0.7"/>')  # fmt: skip
    for k, (kind, color) in enumerate(COLORS.items()):
        body.append(f'<rect x="{10 + k * 100}" y="290" width="12" height="12" fill="{color}"/>')
        body.append(_text(26 + k * 100, 301, kind))
    return _svg(700, 315, body)


def stage_chart(plan) -> str:  # noqa: ANN001
    """The plan table's size column as bars: each stage's tensor bytes by role, the rest of its
    files (their headers) in grey, labelled with the size the table prints."""
    from qwen35_reshard.units import format_bytes

    sizes = [{} for _ in plan.stages]
    for r, stage in enumerate(plan.stages):
        for f in stage.files:
            for t in f.tensors:
                kind = _role(t.source.name)
                sizes[r][kind] = sizes[r].get(kind, 0) + t.source.nbytes
        sizes[r]["headers"] = stage.size - sum(sizes[r].values())
    top = max(stage.size for stage in plan.stages)
    colors = {**COLORS, "headers": "#cccccc"}
    body = [_text(10, 20, "Bytes per stage, by role: the plan table's size column", font_weight="bold")]
    for r, (stage, parts) in enumerate(zip(plan.stages, sizes, strict=True)):
        y, x = 40 + r * 30, 60
        body.append(_text(10, y + 15, stage.dirname))
        for kind, color in colors.items():
            w = 440 * parts.get(kind, 0) / top
            if w:
                body.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="20" fill="{color}"/>')
                x += w
        body.append(_text(x + 5, y + 15, format_bytes(stage.size)))
    y = 40 + len(sizes) * 30
    for k, (kind, color) in enumerate(colors.items()):
        body.append(f'<rect x="{10 + k * 85}" y="{y}" width="12" height="12" fill="{color}"/>')
        body.append(_text(26 + k * 85, y + 11, kind))
    return _svg(620, y + 25, body)


if __name__ == "__main__":
    IMG.mkdir(exist_ok=True)
    plan = _plan()
    for name, svg in (("payoff", payoff()), ("split", split_diagram(plan)), ("stages", stage_chart(plan))):
        (IMG / f"{name}.svg").write_text(svg)
        print(f"wrote {IMG / name}.svg")
