"""The method table (``meta/method/methods.yaml``, shipped with the package): one row per method.

Every consumer reads it from here: the evaluator presets (``meta.evaluation.spec``), the benchmark
scripts (``scripts/run_methods.py``), the results parser, the demo and the tests.  A malformed file
or an unknown key raises :class:`MethodTableError` with a one-line message naming the file / key.

Command line (for shell scripts)::

    python -m meta.method.methods                    # the table
    python -m meta.method.methods keys [--dassl]     # keys in table order (--dassl: those with a trainer)
    python -m meta.method.methods get KEY FIELD      # one field, e.g. `get gram_coop trainer`
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Optional, Union

import yaml

from meta.method.learners import DEFAULT_LEARNER

TABLE_FILE = Path(__file__).with_name("methods.yaml")


class MethodTableError(ValueError):
    """A malformed method table or an unknown method key (one-line message)."""


@dataclass(frozen=True)
class Method:
    """One row of the method table (field meanings: the comment block of ``meta/method/methods.yaml``).

    ``text_tokens`` / ``visual_tokens`` are prompt-token counts; ``trainer`` / ``config`` are ""
    for rows that have no Dassl trainer config (demo-only ablations).
    """

    key: str
    label: str
    preset: str
    text_tokens: int
    visual_tokens: int
    init: bool
    regulate: bool
    zero_shot: bool
    trainer: str = ""
    config: str = ""
    aliases: tuple[str, ...] = ()
    text_depth: int = 1
    vision_depth: int = 1
    coupling: str = "none"
    one_step: bool = False
    learner: str = DEFAULT_LEARNER
    full_label: str = ""

    @property
    def standalone_label(self) -> str:
        """The row's name where it stands alone (a summary row, a sentence): ``full_label`` for a label that reads
        only under another row of its table (Table 4's "- ..." ablations), else ``label``."""
        return self.full_label or self.label

    @property
    def gram_file(self) -> bool:
        """True when the method reads a GRAM init file (θ*, R_φ or both): GRAM is on."""
        return self.init or self.regulate

    @property
    def dassl(self) -> bool:
        """True when the method has a Dassl trainer and config (the benchmark scripts can run it)."""
        return bool(self.trainer)


# The one mapping of a row's fields onto the evaluator's MethodSpec (meta.evaluation.spec): θ's structure, which a
# row's preset fixes, and where fine-tuning starts, which each component row sets on top of its preset.
STRUCTURE_FIELDS = {
    "text_tokens": "n_ctx_text",
    "visual_tokens": "n_ctx_vision",
    **{name: name for name in ("text_depth", "vision_depth", "coupling", "learner")},
}
START_FIELDS = {"regulate": "regulate", "init": "init_prompts"}

_TYPES = {f.name: f.type for f in fields(Method)}
_REQUIRED = [f.name for f in fields(Method) if f.default is MISSING]


def _row(raw: object, index: int, path: Path) -> Method:
    where = f"{path}: methods[{index}]"
    if not isinstance(raw, dict):
        raise MethodTableError(f"{where}: expected a mapping of fields, got {type(raw).__name__}")
    key = raw.get("key", "?")
    where = f"{path}: method {key!r}"
    unknown = sorted(set(raw) - set(_TYPES))
    if unknown:
        raise MethodTableError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(_TYPES)}")
    missing = [name for name in _REQUIRED if name not in raw]
    if missing:
        raise MethodTableError(f"{where}: missing field(s) {', '.join(missing)}")
    values = {}
    for name, value in raw.items():
        want = _TYPES[name]
        if want == "bool":
            ok = isinstance(value, bool)
        elif want == "int":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        elif want == "str":
            ok = isinstance(value, str) and (bool(value) or name in ("trainer", "config"))
        else:  # aliases
            ok = isinstance(value, list) and all(isinstance(v, str) and v for v in value)
            value = tuple(value) if ok else value
        if not ok:
            expected = {"bool": "true or false", "int": "an integer >= 0", "str": "a non-empty string"}.get(
                want, "a list of strings"
            )
            raise MethodTableError(f"{where}: field {name!r} must be {expected}, got {value!r}")
        values[name] = value
    method = Method(**values)
    if bool(method.trainer) != bool(method.config):
        raise MethodTableError(f"{where}: give both 'trainer' and 'config' or neither")
    return method


def load_methods(path: Union[str, Path, None] = None) -> dict[str, Method]:
    """``{key: Method}`` in table order from ``path`` (default: the packaged ``methods.yaml``)."""
    path = Path(path) if path is not None else TABLE_FILE
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as err:
        raise MethodTableError(f"cannot read the method table {path}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MethodTableError(f"{path} is not valid YAML: {first}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("methods"), list) or not doc["methods"]:
        raise MethodTableError(f"{path}: expected a top-level 'methods:' list of rows")
    table: dict[str, Method] = {}
    names: set[str] = set()
    for i, raw in enumerate(doc["methods"]):
        m = _row(raw, i, path)
        for name in (m.key, *m.aliases):
            if name in names:
                raise MethodTableError(f"{path}: method key or alias {name!r} appears twice")
            names.add(name)
        table[m.key] = m
    labels = [m.label for m in table.values()]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise MethodTableError(f"{path}: label(s) {', '.join(map(repr, dup))} used by more than one method")
    for m in table.values():
        if m.label.startswith("- ") and not m.full_label:
            raise MethodTableError(
                f"{path}: method {m.key!r}: label {m.label!r} reads only under another row; give it a full_label"
            )
        own = table.get(m.preset)
        if own is None or own.preset != own.key:
            raise MethodTableError(f"{path}: method {m.key!r}: preset {m.preset!r} is not a row whose preset is itself")
        if m.zero_shot and (m.init or m.regulate or m.text_tokens or m.visual_tokens):
            raise MethodTableError(f"{path}: method {m.key!r}: a zero-shot method has no tokens, init or regulator")
        if m.coupling not in ("none", "maple"):
            raise MethodTableError(f"{path}: method {m.key!r}: coupling must be none or maple, got {m.coupling!r}")
        if m.one_step and not m.regulate:
            raise MethodTableError(
                f"{path}: method {m.key!r}: one_step (the paper-literal regulated fine-tuning) needs regulate true"
            )
        if (m.init or m.regulate) and not table[m.preset].init:
            raise MethodTableError(
                f"{path}: method {m.key!r}: init/regulate need a GRAM init file, but its preset "
                f"{m.preset!r} does not start from one"
            )
    return table


# The sizes of CLIP a learner's reference prompt shape is given for (:meth:`Learner.prompt_fields`): ``tiny``, the
# 2-layer test CLIP of the golden fingerprint and the world's tiny CLIP (depth 0 = every layer, as the method rows
# give it); ``full``, ViT-B/16 as the learner's meta-training config (configs/meta/train_<name>.yaml) shapes it: the
# benchmarks and the planner.
PROMPT_SIZES = ("tiny", "full")
_LEARNER_FIELDS = ("trainer", "text", "vision", "coupling", "vpt_init", "full_text_depth")


@dataclass(frozen=True)
class Learner:
    """One prompt learner (a Dassl trainer): whether it learns text context, its own visual prompt tokens, and how
    the towers' prompts are tied (``coupling``, :class:`meta.method.prompts.PromptSpec`).

    ``name`` and ``shape`` come from its reference row, the first method row with learnable prompts in table order
    (``""`` / ``()`` without one): the row's key names the learner in the golden fingerprint's digests and in the
    benchmarks' and planner's figures, ``shape`` holds that row's PromptSpec fields as ``(field, value)`` pairs (plus
    ``vpt_init`` when the learner row gives one).  ``full_text_depth`` (``None``: the row's depth) is the text depth at
    full size where the method rows take every layer of the world's 2-layer CLIP.
    """

    trainer: str
    text: bool
    vision: bool
    coupling: str = "none"
    vpt_init: str = ""
    full_text_depth: Optional[int] = None
    name: str = ""
    shape: tuple = ()

    @property
    def prompts_image(self) -> bool:
        """True when the learner puts tokens into the image tower (its own or through a coupling): ViT CLIPs only."""
        return self.vision or self.coupling != "none"

    def prompt_fields(self, size: str = "tiny") -> dict:
        """``{PromptSpec field: value}`` of the reference shape at ``size`` (:data:`PROMPT_SIZES`); fields left out take
        PromptSpec's defaults.  :class:`MethodTableError` for an unknown size or a learner without a reference row."""
        if size not in PROMPT_SIZES:
            raise MethodTableError(f"prompt size {size!r}: expected one of {', '.join(PROMPT_SIZES)}")
        if not self.shape:
            raise MethodTableError(f"learner {self.trainer!r} has no method row with learnable prompts (no shape)")
        fields = dict(self.shape)
        if size == "full" and self.full_text_depth is not None:
            fields["text_depth"] = self.full_text_depth
        return fields

    @property
    def deep(self) -> bool:
        """True when the reference shape prompts more than the first layer of a tower, or couples the towers
        (IVLP, MaPLe); False for the shallow learners (CoOp, VPT, UNIGRAM)."""
        fields = dict(self.shape)
        return (
            fields.get("text_depth", 1) != 1
            or fields.get("vision_depth", 1) != 1
            or fields.get("coupling", "none") != "none"
        )


def _reference_shape(method: Method, vpt_init: str) -> tuple:
    """``(field, value)`` pairs of the PromptSpec of ``method``'s prompts: token counts always, depths, coupling and
    prompt learner where they differ from the table's defaults, ``vpt_init`` when given."""
    out = [("n_ctx_text", method.text_tokens), ("n_ctx_vision", method.visual_tokens)]
    for name, default in (("text_depth", 1), ("vision_depth", 1), ("coupling", "none"), ("learner", DEFAULT_LEARNER)):
        if getattr(method, name) != default:
            out.append((name, getattr(method, name)))
    if vpt_init:
        out.append(("vpt_init", vpt_init))
    return tuple(out)


def load_learners(path: Union[str, Path, None] = None) -> dict[str, Learner]:
    """``{trainer: Learner}`` in table order from the ``learners:`` list of ``path`` (default: the packaged
    table), each method row's trainer, tokens and coupling checked against its learner."""
    path = Path(path) if path is not None else TABLE_FILE
    table = load_methods(path)
    doc = yaml.safe_load(path.read_text())
    rows = doc.get("learners") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        raise MethodTableError(f"{path}: expected a top-level 'learners:' list of rows")
    out: dict[str, Learner] = {}
    for i, raw in enumerate(rows):
        if not isinstance(raw, dict) or set(raw) - set(_LEARNER_FIELDS) or "trainer" not in raw:
            raise MethodTableError(
                f"{path}: learners[{i}]: expected trainer, text, vision, coupling (and optional vpt_init, "
                f"full_text_depth), got {raw!r}"
            )
        if not all(isinstance(raw.get(k), bool) for k in ("text", "vision")):
            raise MethodTableError(f"{path}: learner {raw['trainer']!r}: text and vision must be true or false")
        vpt_init = raw.get("vpt_init", "")
        if not isinstance(vpt_init, str) or ("vpt_init" in raw and not (vpt_init and raw["vision"])):
            raise MethodTableError(
                f"{path}: learner {raw['trainer']!r}: vpt_init must be a non-empty string, for a learner with "
                f"visual tokens (vision true), got {vpt_init!r}"
            )
        depth = raw.get("full_text_depth")
        if "full_text_depth" in raw and (
            not isinstance(depth, int) or isinstance(depth, bool) or depth < 0 or not raw["text"]
        ):
            raise MethodTableError(
                f"{path}: learner {raw['trainer']!r}: full_text_depth must be an integer >= 0 (0 = every layer), "
                f"for a learner with text context (text true), got {depth!r}"
            )
        row = Learner(
            str(raw["trainer"]), raw["text"], raw["vision"], str(raw.get("coupling", "none")), vpt_init, depth
        )
        if row.coupling not in ("none", "maple") or (row.coupling == "maple" and (row.vision or not row.text)):
            raise MethodTableError(
                f"{path}: learner {row.trainer!r}: coupling must be none, or maple with text "
                f"and no visual tokens of its own"
            )
        if row.trainer in out:
            raise MethodTableError(f"{path}: learner {row.trainer!r} appears twice")
        out[row.trainer] = row
    for m in table.values():
        if not m.trainer:
            continue
        learner = out.get(m.trainer)
        if learner is None:
            raise MethodTableError(f"{path}: method {m.key!r}: trainer {m.trainer!r} is not in 'learners'")
        if (
            (m.text_tokens and not learner.text)
            or (m.visual_tokens and not learner.vision)
            or (not m.zero_shot and m.coupling != learner.coupling)
        ):
            raise MethodTableError(
                f"{path}: method {m.key!r}: tokens {m.text_tokens}+{m.visual_tokens} / coupling "
                f"{m.coupling} do not fit learner {m.trainer!r} ({learner})"
            )
    for trainer, row in out.items():
        reference = next((m for m in table.values() if m.trainer == trainer and not m.zero_shot), None)
        if reference is not None:
            out[trainer] = replace(row, name=reference.key, shape=_reference_shape(reference, row.vpt_init))
    return out


@lru_cache(maxsize=None)
def _packaged() -> dict[str, Method]:
    return load_methods()


@lru_cache(maxsize=None)
def _packaged_learners() -> dict[str, Learner]:
    return load_learners()


def learners() -> dict[str, Learner]:
    """The packaged learner table ``{trainer: Learner}`` in table order (read once)."""
    return dict(_packaged_learners())


def learner_shapes(size: str = "tiny") -> dict[str, dict]:
    """``{learner name: PromptSpec fields}`` of every learner of the packaged table with a reference row, in table
    order, at ``size`` (:data:`PROMPT_SIZES`; :meth:`Learner.prompt_fields`): the golden fingerprint runs the
    ``tiny`` shapes, the benchmarks and the planner measure the ``full`` ones."""
    return {row.name: row.prompt_fields(size) for row in _packaged_learners().values() if row.name}


def methods() -> dict[str, Method]:
    """The packaged table ``{key: Method}`` in table order (read once)."""
    return dict(_packaged())


def canonical_key(key: str) -> str:
    """``key`` itself or the key an alias names; :class:`MethodTableError` if unknown."""
    table = _packaged()
    if key in table:
        return key
    for m in table.values():
        if key in m.aliases:
            return m.key
    raise MethodTableError(f"unknown method {key!r}: expected one of {' '.join(table)} ({TABLE_FILE.name})")


def get(key: str) -> Method:
    """The row of ``key`` (or of the method an alias names)."""
    return _packaged()[canonical_key(key)]


def label(key: str) -> str:
    """The paper's row name of ``key``; a key not in the table (e.g. a foreign ``TRAINER/CFG``) is its own label."""
    try:
        return get(key).label
    except MethodTableError:
        return key


def preset_keys() -> tuple[str, ...]:
    """Keys of the rows that define an evaluator preset (``preset == key``), in table order."""
    return tuple(m.key for m in _packaged().values() if m.preset == m.key)


def dassl_keys() -> tuple[str, ...]:
    """Keys of the methods with a Dassl trainer and config, in table order."""
    return tuple(m.key for m in _packaged().values() if m.dassl)


def main(argv: Optional[list[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if not args:
            table = _packaged()
            print(f"{'key':<19} {'trainer':<10} {'init':<5} {'reg':<5} {'zs':<5} tokens  label")
            for m in table.values():
                print(
                    f"{m.key:<19} {m.trainer or '-':<10} {str(m.init).lower():<5} {str(m.regulate).lower():<5} "
                    f"{str(m.zero_shot).lower():<5} {m.text_tokens}+{m.visual_tokens}     {m.label}"
                )
            return 0
        if args[0] == "keys" and args[1:] in ([], ["--dassl"]):
            print(" ".join(dassl_keys() if args[1:] else tuple(_packaged())))
            return 0
        if args[0] == "get" and len(args) == 3:
            m = get(args[1])
            if args[2] not in _TYPES:
                raise MethodTableError(f"unknown field {args[2]!r}: expected one of {', '.join(_TYPES)}")
            value = getattr(m, args[2])
            print({bool: lambda v: str(v).lower(), tuple: " ".join}.get(type(value), str)(value))
            return 0
    except MethodTableError as err:
        print(err, file=sys.stderr)
        return 1
    print("usage: python -m meta.method.methods [keys [--dassl] | get KEY FIELD]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
