"""What is wrong with a split, as data: a checker returns findings, it does not raise them."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import Audience, advice, spell
from ..format.names import STAGE_MANIFEST, TOOL_NAME

# Kinds of problem.
MISSING = "missing"  # something that must be there is not
EXTRA = "extra"  # something is there that must not be
DIFFERENT = "different"  # present, but not what the manifest or the source says
CORRUPT = "corrupt"  # not a valid file of its kind
INCOMPLETE = "incomplete"  # a stage or run that was not finished
KINDS = (MISSING, EXTRA, DIFFERENT, CORRUPT, INCOMPLETE)

# What to do, as advice (errors.advice) of three kinds, which a server operator's terms word
# otherwise (servers.terms): finish an interrupted run, build a stage anew, restore its files.
RERUN = advice("rerun", f"run the same {TOOL_NAME} command again") + " to resume"
REBUILD = advice("rebuild", f"delete it and run the same {TOOL_NAME} command again (or copy the stage again)")
REPAIR = advice("repair", "restore it from the source with verify --source MODEL --repair")


@dataclass(frozen=True)
class Finding:
    """One thing wrong with a split: its kind, a one-line message, and where (stage directory,
    file, tensor). ``read_stage`` leaves ``stage`` unset; ``verify`` fills it in. ``text`` is
    the message with its parameters and advice marked (:func:`~..errors.param`,
    :func:`~..errors.advice`), for its reader's terms (:meth:`render`); ``message`` says it as
    the library does."""

    kind: str
    text: str
    file: str | None = None
    tensor: str | None = None
    stage: str | None = None  # stage directory name (pp0); None for the run directory

    @property
    def message(self) -> str:
        return spell(self.text, {})

    def render(self, audience: Audience) -> str:
        """The message in ``audience``'s terms."""
        return spell(self.text, audience.flags, audience.advice)

    def to_dict(self, audience: Audience | None = None) -> dict:
        """The finding as JSON-ready data, its message in ``audience``'s terms (else the library's)."""
        return {
            "kind": self.kind, "message": self.render(audience or Audience()), "file": self.file,
            "tensor": self.tensor, "stage": self.stage,
        }  # fmt: skip


def tensor_digest_finding(where: str, file: str, tensor: str, algorithm: str) -> Finding:
    """What verify and the loader say of tensor ``tensor`` of data file ``file`` (``where``: the
    file as the user spells it) whose bytes do not hash to the digest (of ``algorithm``, as
    the manifest's format says: ``format.digest``) its manifest records."""
    why = (
        f"{where}: the bytes of tensor {tensor!r} do not match its {algorithm} in {STAGE_MANIFEST}; the "
        "file is damaged"
    )
    return Finding(DIFFERENT, why, file, tensor)
