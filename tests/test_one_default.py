"""Every setting has one default: a config key built into a spec field reads that field's default.

The table is :data:`meta.config.KEY_FIELDS` (key -> spec field, SAME / OWN / SPELLED).  The schemas are read twice:
as built (``get_meta_cfg_default()``, ``trainers.gram.extend_cfg``, the evaluator's parser) for the values, and as
source (``ast``) for how each default is written.  A SAME key written as a literal (``0.01``, ``"none"``, ``(0.08,
1.0)``) fails even when the value agrees, and so does a key named as a field of its node's specs that the table
does not list: a second literal cannot come back unnoticed.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
from pathlib import Path
from typing import Any

import pytest
from yacs.config import CfgNode as CN

from meta.config import KEY_FIELDS, NODE_SPECS, OWN, RELATIONS, SAME, SPELLED, KeyField, get_meta_cfg_default
from meta.evaluation.cli import _parser
from meta.evaluation.spec import MethodSpec
from trainers.gram.config import extend_cfg

ROOT = Path(__file__).resolve().parents[1]
# Where each schema writes its defaults: (file, function) -> key prefix of the node variable it assigns to.
YACS_WRITERS = {
    ("meta/config.py", "get_meta_cfg_default"): "",
    ("meta/config.py", "_model_node"): "MODEL.",
    ("meta/config.py", "_chc_node"): "CHC.",
    ("meta/config.py", "_tasks_node"): "TASKS.",
    ("meta/config.py", "add_metatrain_cfg"): "META.",
    ("trainers/gram/config.py", "_gram_defaults"): "TRAINER.GRAM.",
}
FLAG_WRITER = "meta/evaluation/cli.py"


def _flatten(node: CN, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, CN):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@functools.lru_cache(maxsize=1)
def built_defaults() -> dict[str, Any]:
    """Every key's default as the schemas build it: META's tree, TRAINER.GRAM on a bare node, the flags."""
    out = _flatten(get_meta_cfg_default())
    out.update({k: v for k, v in _flatten(extend_cfg(CN())).items() if k.startswith("TRAINER.GRAM.")})
    parser = _parser()
    args = {
        **vars(parser.parse_args(["transfer", "--source", "x", "--targets", "y"])),
        **vars(parser.parse_args(["base2new", "--dataset", "x"])),
    }
    for flag in written_flags(_source(FLAG_WRITER)):
        out[flag] = args[flag[2:].replace("-", "_")]
    return out


def _source(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text(), filename=path)


def _chain(target: ast.expr) -> list[str]:
    """``m.REGULATOR.INIT_STD`` -> ``["m", "REGULATOR", "INIT_STD"]``; [] for anything else."""
    parts = []
    while isinstance(target, ast.Attribute):
        parts.append(target.attr)
        target = target.value
    return [target.id, *reversed(parts)] if isinstance(target, ast.Name) and parts else []


def written_yacs(tree: ast.Module, functions: dict[str, str]) -> dict[str, ast.expr]:
    """``{key: value expression}`` of every ``node.KEY = value`` in the named functions (prefix per function)."""
    out = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name in functions:
            for stmt in ast.walk(fn):
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and _chain(stmt.targets[0]):
                    out[functions[fn.name] + ".".join(_chain(stmt.targets[0])[1:])] = stmt.value
    return out


def written_flags(tree: ast.Module) -> dict[str, ast.expr]:
    """``{"--flag": default expression}`` of every ``add_argument("--flag", ..., default=...)``."""
    out = {}
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument":
            flag = call.args[0].value if call.args and isinstance(call.args[0], ast.Constant) else ""
            default = [kw.value for kw in call.keywords if kw.arg == "default"]
            if str(flag).startswith("--") and default:
                out[flag] = default[0]
    return out


@functools.lru_cache(maxsize=1)
def written_sources() -> dict[str, ast.expr]:
    out: dict[str, ast.expr] = {}
    for path in sorted({path for path, _ in YACS_WRITERS}):
        out.update(written_yacs(_source(path), {fn: prefix for (p, fn), prefix in YACS_WRITERS.items() if p == path}))
    out.update(written_flags(_source(FLAG_WRITER)))
    return out


def field_expression(owner: type, field: str) -> ast.expr:
    """The expression ``owner``'s class body writes ``field``'s default with."""
    tree = ast.parse(Path(inspect.getsourcefile(owner)).read_text())
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and cls.name == owner.__name__:
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == field:
                    return stmt.value
    raise AssertionError(f"{owner.__name__}.{field}: no default written in its class body")


def is_literal(expr: ast.expr) -> bool:
    try:
        ast.literal_eval(expr)
    except ValueError:
        return False
    return True


def second_literal(expr: ast.expr, owner: type, field: str) -> str:
    """Why ``expr`` does not read ``owner.field``'s default ("" when it does): it must be ``Owner.field``
    (``list(...)``/``tuple(...)`` of it for a flag's list), or the very name the field's default is written with."""
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ("list", "tuple"):
        expr = expr.args[0] if len(expr.args) == 1 else expr
    own = field_expression(owner, field)
    if ast.unparse(expr) == f"{owner.__name__}.{field}":
        return ""
    if not is_literal(own) and ast.unparse(expr) == ast.unparse(own):
        return ""
    name = f"{owner.__name__}.{field}"
    return f"written {ast.unparse(expr)}, not {name} (written {ast.unparse(own)}): two sources of one default"


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value  # argparse keeps a list where a spec a tuple


def _same_value(a: Any, b: Any) -> bool:
    """Equal and of one type (0 is not 0.0, False not 0), lists read as tuples."""
    a, b = _as_tuple(a), _as_tuple(b)
    return type(a) is type(b) and a == b


def test_the_table_is_well_formed_and_every_key_exists():
    built = built_defaults()
    keys = [link.key for link in KEY_FIELDS]
    assert len(keys) == len(set(keys)), "a key twice in KEY_FIELDS"
    for link in KEY_FIELDS:
        assert link.relation in RELATIONS, link
        assert link.key in built, f"{link.key}: in KEY_FIELDS but no schema has it"
        link.default()  # the owner has the field, with a default
        if link.relation != SAME:
            assert link.note, f"{link.key}: an {link.relation} key says why / how in its note"


def test_the_source_scan_sees_every_key_the_schemas_build():
    written, built = written_sources(), built_defaults()
    unseen = sorted(set(built) - set(written))
    assert not unseen, f"keys built but not found in the schemas' source (extend YACS_WRITERS): {unseen}"


@pytest.mark.parametrize("link", [k for k in KEY_FIELDS if k.relation == SAME], ids=lambda k: k.key)
def test_a_same_key_reads_its_fields_default(link: KeyField):
    built, written = built_defaults(), written_sources()
    assert _same_value(built[link.key], link.default()), (
        f"{link.key}: default {built[link.key]!r}, {link.owner}.{link.field} has {link.default()!r}"
    )
    problem = second_literal(written[link.key], link.spec(), link.field)
    assert not problem, f"{link.key}: {problem}"


@pytest.mark.parametrize("link", [k for k in KEY_FIELDS if k.relation == OWN], ids=lambda k: k.key)
def test_an_own_key_really_differs(link: KeyField):
    value = built_defaults()[link.key]
    assert not _same_value(value, link.default()), f"{link.key}: equals {link.owner}.{link.field}; make it SAME"


def unlinked_field_keys(built: dict[str, Any]) -> list[str]:
    """Keys named as a field with a default of their node's specs (:data:`NODE_SPECS`) that the table lacks."""
    linked = {link.key for link in KEY_FIELDS}
    out = []
    for key in built:
        node, _, leaf = ("--", "", key[2:].replace("-", "_")) if key.startswith("--") else key.rpartition(".")
        for owner in NODE_SPECS.get(node, ()):
            spec = KeyField(key, owner, "").spec()
            defaults = {f.name for f in dataclasses.fields(spec) if f.default is not dataclasses.MISSING}
            if leaf.lower() in defaults and key not in linked:
                out.append(f"{key} ({owner}.{leaf.lower()})")
    return out


def test_every_key_named_as_a_spec_field_is_in_the_table():
    missing = unlinked_field_keys(built_defaults())
    assert not missing, f"keys named as a spec field but not in meta.config.KEY_FIELDS: {missing}"


def test_the_spelled_keys_decode_to_their_fields_defaults():
    """The spellings the notes document, at the defaults: Dassl's VPT_DEEP False is shallow VPT (vision_depth 1, as
    META.PROMPT.VISION_DEPTH); META.REGULATOR.BETA_SCALE 0 is RegulatorSpec's "grad_rms"."""
    from meta.metatrain.settings import regulator_spec
    from meta.method.prompts import PromptSpec

    spelled = {k.key for k in KEY_FIELDS if k.relation == SPELLED}
    assert {"TRAINER.GRAM.VPT_DEEP", "TRAINER.GRAM.VPT_DEPTH", "META.REGULATOR.BETA_SCALE"} <= spelled
    built = built_defaults()
    assert built["TRAINER.GRAM.VPT_DEEP"] is False and built["META.PROMPT.VISION_DEPTH"] == PromptSpec.vision_depth == 1
    assert regulator_spec(get_meta_cfg_default()).beta_scale == "grad_rms"


def test_method_spec_reads_the_defaults_of_the_specs_it_builds():
    """MethodSpec's fields named as a PromptSpec / StartSpec field (and its consistency weights) read them."""
    from meta.finetune.engine import StartSpec
    from meta.method.consistency import ConsistencySpec
    from meta.method.prompts import PromptSpec

    owners = {f.name: (spec, f.name) for spec in (PromptSpec, StartSpec) for f in dataclasses.fields(spec)}
    owners.update(
        consistency_text=(ConsistencySpec, "text_weight"), consistency_image=(ConsistencySpec, "image_weight")
    )
    checked = 0
    for f in dataclasses.fields(MethodSpec):
        if f.name in owners and f.default is not dataclasses.MISSING and f.name != "launch":  # launch: None = rule
            spec, name = owners[f.name]
            assert _same_value(f.default, getattr(spec, name)), f"MethodSpec.{f.name}"
            problem = second_literal(field_expression(MethodSpec, f.name), spec, name)
            assert not problem, f"MethodSpec.{f.name}: {problem}"
            checked += 1
    assert checked >= 15


# ---- the checks themselves catch what they guard: a planted literal and a planted unlinked key


def test_a_literal_duplicate_is_reported():
    from meta.method.prompts import PromptSpec
    from meta.method.regulator import RegulatorSpec

    planted = ast.parse("def f():\n    m.REGULATOR.INIT_STD = 0.01\n    m.REGULATOR.FORM = RegulatorSpec.form\n")
    written = written_yacs(planted, {"f": "META."})
    assert second_literal(written["META.REGULATOR.INIT_STD"], RegulatorSpec, "init_std") == (
        "written 0.01, not RegulatorSpec.init_std (written 0.01): two sources of one default"
    )
    assert second_literal(written["META.REGULATOR.FORM"], RegulatorSpec, "form") == ""
    # a shared name reads the default only where the field's default is written with that very name
    assert second_literal(ast.parse("DEFAULT_TEMPLATE").body[0].value, PromptSpec, "template") == ""
    assert second_literal(ast.parse("DEFAULT_TEMPLATE").body[0].value, RegulatorSpec, "form")


def test_a_new_key_named_as_a_field_must_be_linked():
    built = dict(built_defaults(), **{"TRAINER.GRAM.INIT_STD": 0.02, "--text-depth": 1})
    missing = unlinked_field_keys(built)
    assert missing == [
        "TRAINER.GRAM.INIT_STD (meta.method.prompts:PromptSpec.init_std)",
        "--text-depth (meta.method.prompts:PromptSpec.text_depth)",
    ]
