"""Export and import of the meta-learned initialisation θ* and regulator φ.

File format (one ``.safetensors`` file, nothing is unpickled on load):

* tensors ``prompt.ctx`` ``[M, d_t]`` and/or ``prompt.vpt`` ``[D, n, d_v]``; for deep text prompts ``prompt.ctx_deep``
  ``[J-1, M, d_t]``, for MaPLe's coupling ``prompt.proj_weight`` ``[J, d_v, d_t]`` and ``prompt.proj_bias`` ``[J, d_v]``
  (:mod:`meta.method.prompts`); ``regulator.<tensor>.{gamma,beta}.{weight,bias}`` when φ was learned (the spec in the
  header carries every option the test-time regulator needs, and files written before an option existed load with its
  "off" default; a field of a removed option, :data:`meta.config.REMOVED_KEYS`, is dropped at its off value and refused
  when it was on); ``prototypes.{topics,domains,mean,std}`` (``[K_t, E]``, ``[K_d, E]``, ``[2]``, ``[2]``) when R_φ
  was meta-trained on the CHC prototypes (:mod:`meta.method.prototypes`), all four or none;
* header metadata key ``"gram"``: JSON with ``format_version``, ``backbone`` (model name, weights file name, widths),
  ``prompt`` (token counts, depths, coupling; files written before deep text prompts existed lack ``text_depth`` and
  ``coupling`` and read as 1 / ``none``), ``regulator`` (spec or null), ``shapes`` and free-form ``provenance``.

Loading validates the metadata's fields and types, each tensor's shape against ``shapes`` and the metadata's widths
and token counts, then the metadata against what the caller builds: each failure is one :class:`InitMismatchError` line
naming the file and the field.  The writer stores float32; float16 / bfloat16 / float64 tensors load cast to float32
(an overflow is refused as infinite), any other dtype is refused by name.

Also: :func:`export_coop_context` writes θ*_T as stock CoOp/CoCoOp load it through ``MODEL.INIT_WEIGHTS`` (``ctx``
``[n_ctx, 512]`` for ViT-B/16), a plain tensor dict that ``torch.load(weights_only=True)`` accepts.
"""

from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import nn

from meta.infra.fileio import parse_json, write_bytes_atomic
from meta.method.learners import DEFAULT_LEARNER, get_learner, learner_keys
from meta.method.prompts import COUPLINGS, PromptParams
from meta.method.prototypes import CONTEXT_DIM, Prototypes
from meta.method.prototypes import TENSORS as PROTOTYPE_TENSORS
from meta.method.regulator import GradientRegulator, RegulatorSpec, regulator_for
from meta.model.backbone import ClipDims

FORMAT_VERSION = 1


class InitMismatchError(ValueError):
    """The initialisation file does not fit the model being built."""


@dataclass
class GramInit:
    """A loaded initialisation: θ*, optional φ, and its metadata."""

    prompt: dict[str, torch.Tensor]
    regulators: dict[str, dict[str, torch.Tensor]]
    metadata: dict[str, Any]
    path: Optional[Path] = None
    prototype_tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def prototypes(self) -> Optional[Prototypes]:
        """The CHC prototypes the file stores (None when it stores none)."""
        return Prototypes.from_tensors(self.prototype_tensors) if self.prototype_tensors else None

    def prompt_module(self) -> PromptParams:
        """θ* as a :class:`meta.method.prompts.PromptParams` of the learner the file records."""
        return PromptParams(learner_key(self.metadata.get("prompt", {})), **self.prompt)

    def regulator_modules(self) -> dict[str, nn.Module]:
        """``{tensor name: R_φ}`` rebuilt from the stored spec and weights (a :class:`GradientRegulator`, or a
        :class:`meta.method.regulator.GradientGate` for the gate form)."""
        spec_d = self.metadata.get("regulator")
        if not spec_d or not self.regulators:
            return {}
        spec = RegulatorSpec(**spec_d)
        out = {}
        for name, tensors in self.regulators.items():
            reg = regulator_for(int(self.prompt[name].shape[-1]), spec)
            reg.load_state_dict(tensors)
            out[name] = reg
        return out


def export_gram_init(
    path: Union[str, Path],
    prompts: PromptParams,
    regulators: Optional[Mapping[str, GradientRegulator]],
    dims: ClipDims,
    provenance: Optional[dict] = None,
    weights: str = "",
    prototypes: Optional[Mapping[str, torch.Tensor]] = None,
) -> Path:
    """Write θ* (and φ, and ``prototypes``: :meth:`meta.method.prototypes.Prototypes.tensors`) with metadata,
    atomically (:mod:`meta.infra.fileio`); returns the path written."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {k: v.detach().float().cpu().contiguous() for k, v in (prototypes or {}).items()}
    for name, p in prompts.named_parameters():
        tensors[f"prompt.{name}"] = p.detach().float().cpu().contiguous()
    reg_spec = None
    for name, reg in (regulators or {}).items():
        reg_spec = reg.spec.as_dict()
        for k, v in reg.state_dict().items():
            tensors[f"regulator.{name}.{k}"] = v.detach().float().cpu().contiguous()
    meta = {
        "format_version": FORMAT_VERSION,
        "backbone": {
            "model_name": dims.model_name,
            "weights": Path(weights).name if weights else "",
            **{k: getattr(dims, k) for k in ("text_width", "vision_width", "vision_layers", "text_layers")},
        },
        "prompt": prompts.structure(),
        "regulator": reg_spec,
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "provenance": provenance or {},
    }
    return write_bytes_atomic(path, safetensors_bytes(tensors, metadata={"gram": json.dumps(meta, sort_keys=True)}))


_MISSING = object()


def learner_key(prompt: Mapping[str, Any]) -> str:
    """The prompt learner an init file's ``prompt`` metadata names (files without the field: the built-in one)."""
    return prompt.get("learner", DEFAULT_LEARNER)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"


class _Checker:
    """Raises :class:`InitMismatchError` as ``<key>: <file>: <field>: <what>``."""

    def __init__(self, config_key: str, path: Path):
        self.prefix = f"{config_key}: {path}"

    def fail(self, field: str, what: str) -> None:
        raise InitMismatchError(f"{self.prefix}: {field}: {what}")

    def need(self, cond: bool, field: str, what: str) -> None:
        if not cond:
            self.fail(field, what)


def _regulator_field_types() -> dict[str, tuple]:
    """``{field: accepted python types}`` from :class:`RegulatorSpec`'s fields (new fields included)."""
    kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}
    out = {}
    for f in dataclasses.fields(RegulatorSpec):
        types = kinds.get(type(f.default), ())
        if types == (str,) and ("float" in str(f.type) or "int" in str(f.type)):  # a string or a number
            types = (str, int, float)
        out[f.name] = types
    return out


def drop_removed_fields(reg: dict, check: _Checker) -> None:
    """Delete from an init file's ``regulator`` record, in place, the fields of removed options at their off value;
    one that was on is refused."""
    from meta.config import REMOVED_KEYS  # lazy: meta.config imports the meta-learner

    removed = {r.field: r for r in REMOVED_KEYS if r.field}
    values = {removed[name].key: value for name, value in reg.items() if name in removed}
    for name in [n for n in reg if n in removed]:
        option = removed[name]
        check.need(
            not option.is_on(values),
            f"regulator.{name}",
            f"{_describe(reg[name])}: {option.key} was removed (measured and dropped: docs/evidence.md, Options "
            f"removed), so this code cannot rebuild the regulator; use commit b3be65a or earlier for this file",
        )
        del reg[name]


def check_metadata(raw: Any, check: _Checker) -> dict:
    """Parse and validate the ``"gram"`` header metadata (see module docstring); returns it as a dict."""
    if not isinstance(raw, str):
        check.fail("metadata 'gram'", "missing; was the file written by export_gram_init?")
    try:
        meta = parse_json(raw)
    except json.JSONDecodeError as err:
        check.fail("metadata 'gram'", f"not valid JSON ({err.msg} at character {err.pos})")
    except ValueError as err:  # nested too deeply (parse_json's limit, never a RecursionError)
        check.fail("metadata 'gram'", str(err))
    check.need(isinstance(meta, dict), "metadata 'gram'", f"expected a JSON object, got {_describe(meta)}")
    version = meta.get("format_version", _MISSING)
    check.need(version is not _MISSING, "format_version", f"missing (expected the integer {FORMAT_VERSION})")
    check.need(
        _is_int(version) and version == FORMAT_VERSION,
        "format_version",
        f"expected the integer {FORMAT_VERSION}, got {_describe(version)}",
    )
    sections = {
        "backbone": (("text_width", 1), ("vision_width", 1), ("vision_layers", 1)),
        "prompt": (("n_ctx_text", 0), ("n_ctx_vision", 0), ("vision_depth", 0)),
    }
    for section, fields in sections.items():
        node = meta.get(section, _MISSING)
        check.need(node is not _MISSING, section, "missing")
        check.need(
            isinstance(node, dict),
            section,
            f"expected an object with {', '.join(f for f, _ in fields)}, got {_describe(node)}",
        )
        for name, minimum in fields:
            value = node.get(name, _MISSING)
            check.need(value is not _MISSING, f"{section}.{name}", "missing")
            check.need(
                _is_int(value) and value >= minimum,
                f"{section}.{name}",
                f"expected an integer >= {minimum}, got {_describe(value)}",
            )
    backbone, prompt = meta["backbone"], meta["prompt"]
    for name in ("model_name", "weights"):
        value = backbone.get(name, "")
        check.need(isinstance(value, str), f"backbone.{name}", f"expected a string, got {_describe(value)}")
    check.need(
        (prompt["n_ctx_vision"] == 0) == (prompt["vision_depth"] == 0),
        "prompt.vision_depth",
        f"{prompt['vision_depth']} does not go with prompt.n_ctx_vision {prompt['n_ctx_vision']} (both 0, or both > 0)",
    )
    check.need(
        prompt["vision_depth"] <= backbone["vision_layers"],
        "prompt.vision_depth",
        f"{prompt['vision_depth']} exceeds backbone.vision_layers {backbone['vision_layers']}",
    )
    check.need(
        prompt["n_ctx_text"] > 0 or prompt["n_ctx_vision"] > 0,
        "prompt",
        "holds no prompt (n_ctx_text and n_ctx_vision are both 0)",
    )
    key = learner_key(prompt)
    check.need(
        isinstance(key, str) and key in learner_keys(),
        "prompt.learner",
        f"expected one of the registered prompt learners {', '.join(learner_keys())}, got {_describe(key)}",
    )
    if key == DEFAULT_LEARNER:
        _check_deep_structure(backbone, prompt, check)

    reg = meta.get("regulator", None)
    if reg is not None:
        check.need(isinstance(reg, dict), "regulator", f"expected null or an object, got {_describe(reg)}")
        drop_removed_fields(reg, check)
        types = _regulator_field_types()
        for name, value in reg.items():
            check.need(name in types, f"regulator.{name}", f"unknown field (this code reads {', '.join(types)})")
            ok = not types[name] or (
                isinstance(value, types[name]) and (bool not in types[name]) == (not isinstance(value, bool))
            )
            check.need(
                ok,
                f"regulator.{name}",
                f"expected {' or '.join(t.__name__ for t in types[name])}, got {_describe(value)}",
            )
        try:
            RegulatorSpec(**reg)
        except (TypeError, ValueError) as err:
            check.fail("regulator", str(err))
    shapes = meta.get("shapes", _MISSING)
    check.need(shapes is not _MISSING, "shapes", "missing")
    check.need(isinstance(shapes, dict), "shapes", f"expected an object {{tensor: [dims]}}, got {_describe(shapes)}")
    for name, dims in shapes.items():
        check.need(
            isinstance(dims, list) and all(_is_int(d) and d >= 0 for d in dims),
            f"shapes.{name}",
            f"expected a list of non-negative integers, got {_describe(dims)}",
        )
    provenance = meta.get("provenance", {})
    check.need(isinstance(provenance, dict), "provenance", f"expected an object, got {_describe(provenance)}")
    return meta


def _check_deep_structure(backbone: dict, prompt: dict, check: _Checker) -> None:
    """``prompt.text_depth`` / ``prompt.coupling`` (filled in as 1|0 / ``none`` when an older file lacks them)."""
    prompt.setdefault("text_depth", 1 if prompt["n_ctx_text"] else 0)
    prompt.setdefault("coupling", "none")
    depth, coupling = prompt["text_depth"], prompt["coupling"]
    check.need(_is_int(depth) and depth >= 0, "prompt.text_depth", f"expected an integer >= 0, got {_describe(depth)}")
    check.need(
        (depth == 0) == (prompt["n_ctx_text"] == 0),
        "prompt.text_depth",
        f"{depth} does not go with prompt.n_ctx_text {prompt['n_ctx_text']} (both 0, or both > 0)",
    )
    text_layers = backbone.get("text_layers")
    if text_layers is not None:
        check.need(
            _is_int(text_layers) and text_layers >= 1,
            "backbone.text_layers",
            f"expected an integer >= 1, got {_describe(text_layers)}",
        )
        check.need(depth <= text_layers, "prompt.text_depth", f"{depth} exceeds backbone.text_layers {text_layers}")
    check.need(
        coupling in COUPLINGS, "prompt.coupling", f"expected one of {', '.join(COUPLINGS)}, got {_describe(coupling)}"
    )
    if coupling == "maple":
        check.need(
            prompt["n_ctx_text"] > 0 and prompt["n_ctx_vision"] == 0,
            "prompt.coupling",
            f"'maple' derives the visual prompts from the text prompts: needs n_ctx_text > 0 and "
            f"n_ctx_vision 0, got {prompt['n_ctx_text']} and {prompt['n_ctx_vision']}",
        )
        check.need(
            depth <= backbone["vision_layers"],
            "prompt.text_depth",
            f"{depth} exceeds backbone.vision_layers {backbone['vision_layers']} (coupling 'maple')",
        )


# Dtypes a file may hold besides float32: cast to float32 on load (:func:`load_gram_init`).
CAST_TO_FLOAT32 = (torch.float16, torch.bfloat16, torch.float64)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_tensors(tensors: Mapping[str, torch.Tensor], meta: dict, check: _Checker) -> None:
    """Each tensor against ``meta["shapes"]`` and against the widths / token counts the metadata records."""
    shapes = meta["shapes"]
    extra, missing = sorted(set(tensors) - set(shapes)), sorted(set(shapes) - set(tensors))
    check.need(not extra, "shapes", f"does not list tensor(s) {', '.join(extra)} that the file holds")
    check.need(not missing, "shapes", f"lists tensor(s) {', '.join(missing)} that the file does not hold")
    for name, t in tensors.items():
        check.need(
            list(t.shape) == shapes[name],
            f"tensor {name}",
            f"has shape {list(t.shape)}, but shapes.{name} records {shapes[name]}",
        )
        check.need(
            t.dtype == torch.float32 or t.dtype in CAST_TO_FLOAT32,
            f"tensor {name}",
            f"dtype {_dtype_name(t.dtype)} is not accepted; expected float32 "
            f"({', '.join(_dtype_name(d) for d in CAST_TO_FLOAT32)} are cast to float32 on load)",
        )
        cast = "" if t.dtype == torch.float32 else f" once cast from {_dtype_name(t.dtype)} to float32"
        check.need(bool(torch.isfinite(t.float()).all()), f"tensor {name}", f"holds NaN or infinite values{cast}")
    bb, pr = meta["backbone"], meta["prompt"]
    learner = get_learner(learner_key(pr))
    try:
        want = learner.shapes_of(pr, bb)
    except (KeyError, TypeError, ValueError) as err:
        check.fail("prompt", f"does not describe a {learner.key!r} prompt ({type(err).__name__}: {err})")
    for name in learner.tensor_names:
        t = tensors.get(f"prompt.{name}")
        have = None if t is None else list(t.shape)
        if name not in want:
            check.need(
                have is None, f"tensor prompt.{name}", f"present ({have}) but the metadata records no such prompt"
            )
        else:
            shape, why = want[name]
            check.need(have is not None, f"tensor prompt.{name}", f"missing; the metadata records {why} = {shape}")
            check.need(have == shape, f"tensor prompt.{name}", f"has shape {have}, but the metadata's {why} is {shape}")
    names = learner.tensor_names
    listed = "|".join(names)
    for name in tensors:
        head = name.split(".", 2)
        ok = (
            (head[0] == "prompt" and len(head) == 2 and head[1] in names)
            or (head[0] == "regulator" and len(head) == 3 and head[1] in names)
            or (head[0] == "prototypes" and len(head) == 2 and head[1] in PROTOTYPE_TENSORS)
        )
        check.need(
            ok,
            f"tensor {name}",
            f"unexpected tensor (this code reads prompt.<{listed}>, regulator.<{listed}>.<parameter> and "
            f"prototypes.<{'|'.join(PROTOTYPE_TENSORS)}>)",
        )
    _check_prototypes(tensors, check)
    reg_names = sorted({n.split(".")[1] for n in tensors if n.startswith("regulator.")})
    spec = meta.get("regulator")
    check.need(
        spec is not None or not reg_names,
        "regulator",
        f"null, but the file holds regulator tensors for {', '.join(reg_names)}",
    )
    check.need(spec is None or bool(reg_names), "regulator", "set, but the file holds no regulator tensors")
    for rname in reg_names:
        prompt_t = tensors.get(f"prompt.{rname}")
        check.need(
            prompt_t is not None, f"tensor regulator.{rname}", f"regulates prompt.{rname}, which the file does not hold"
        )
        try:
            with torch.device("meta"):  # shapes only: no memory, no draw from the global RNG
                shell = regulator_for(int(prompt_t.shape[-1]), RegulatorSpec(**spec))
        except ValueError as err:
            check.fail(f"tensor regulator.{rname}", str(err))
        expected = {f"regulator.{rname}.{k}": list(v.shape) for k, v in shell.state_dict().items()}
        found = {n: list(t.shape) for n, t in tensors.items() if n.startswith(f"regulator.{rname}.")}
        for n in sorted(set(expected) | set(found)):
            check.need(n in found, f"tensor {n}", f"missing (expected shape {expected.get(n)})")
            check.need(n in expected, f"tensor {n}", "unexpected regulator tensor")
            check.need(
                found[n] == expected[n],
                f"tensor {n}",
                f"has shape {found[n]}, expected {expected[n]} for prompt.{rname}'s width {int(prompt_t.shape[-1])}",
            )


def _check_prototypes(tensors: Mapping[str, torch.Tensor], check: _Checker) -> None:
    """``prototypes.*``: all four or none; topics ``[K_t, E]`` and domains ``[K_d, E]`` of one width, mean and std
    ``[2]``, std > 0."""
    have = {n.split(".", 1)[1]: t for n, t in tensors.items() if n.startswith("prototypes.")}
    if not have:
        return
    absent = [n for n in PROTOTYPE_TENSORS if n not in have]
    check.need(not absent, "prototypes", f"lacks {', '.join(absent)} (expected all of {', '.join(PROTOTYPE_TENSORS)})")
    topics, domains = have["topics"], have["domains"]
    check.need(
        topics.dim() == 2 and domains.dim() == 2 and topics.shape[1] == domains.shape[1] and len(topics) > 0,
        "prototypes",
        f"topics {list(topics.shape)} and domains {list(domains.shape)}: expected [K_t, E] and [K_d, E], one E",
    )
    for name in ("mean", "std"):
        check.need(list(have[name].shape) == [CONTEXT_DIM], f"tensor prototypes.{name}", f"expected [{CONTEXT_DIM}]")
    check.need(bool((have["std"] > 0).all()), "tensor prototypes.std", "expected every value > 0")


def load_gram_init(
    path: Union[str, Path], expect: Optional[Mapping[str, Any]] = None, config_key: str = "init"
) -> GramInit:
    """Read an initialisation file, validate it, and check it against ``expect`` (any of ``text_width``,
    ``vision_width``, ``n_ctx_text``, ``n_ctx_vision``, ``vision_depth``, ``text_depth``, ``coupling`` must match;
    ``model_name`` only warns).  Problems raise :class:`InitMismatchError` naming ``config_key``, the file and the
    field; a missing file ``FileNotFoundError``.  Tensors come back float32 (module docstring).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{config_key}: GRAM initialisation file not found: {path}")
    check = _Checker(config_key, path)
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        first = " ".join(str(err).split())[:200]
        raise InitMismatchError(f"{config_key}: {path}: not a readable safetensors file ({first})") from None
    meta = check_metadata(header.get("gram"), check)
    check_tensors(tensors, meta, check)
    tensors = {k: v if v.dtype == torch.float32 else v.float() for k, v in tensors.items()}  # see module doc
    prompt = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("prompt.")}
    regs: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("regulator."):
            _, pname, rest = k.split(".", 2)
            regs.setdefault(pname, {})[rest] = v
    found = {**meta["backbone"], **meta["prompt"]}
    problems = []
    for key, want in (expect or {}).items():
        if key == "model_name" or want is None:
            continue
        if key not in found:
            problems.append(f"{key}: file does not record it")
        elif found[key] != want:
            problems.append(f"{key}: file has {found[key]}, model expects {want}")
    if problems:
        raise InitMismatchError(f"{config_key}: {path} does not fit this model: " + "; ".join(problems))
    if expect and expect.get("model_name") and expect["model_name"] != found.get("model_name"):
        import warnings

        warnings.warn(
            f"{config_key}: {path} was meta-trained on {found.get('model_name')}, "
            f"loading into {expect['model_name']} (widths match)",
            stacklevel=2,
        )
    protos = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("prototypes.")}
    return GramInit(prompt=prompt, regulators=regs, metadata=meta, path=path, prototype_tensors=protos)


def coop_context_name(n_ctx: int, stem: str = "coop_ctx") -> str:
    """File name of a stock-CoOp context file: ``coop_ctx_nctx4.pth`` (the N_CTX it needs is in the name)."""
    return f"{stem}_nctx{int(n_ctx)}.pth"


def coop_context_usage(path: Union[str, Path], n_ctx: int) -> str:
    """The options that load a context file into stock CoOp and CoCoOp, one line each, with ``N_CTX`` (default 16;
    Dassl only *warns* on a shape mismatch) and an absolute path (a fork runs from its own folder)."""
    path = Path(path).resolve()
    return "\n".join(
        f'{name}: MODEL.INIT_WEIGHTS {path} TRAINER.{node}.N_CTX {int(n_ctx)} TRAINER.{node}.CTX_INIT ""'
        for name, node in (("stock CoOp", "COOP"), ("stock CoCoOp", "COCOOP"))
    )


def export_coop_context(path: Union[str, Path], ctx: torch.Tensor, epoch: int = 0) -> Path:
    """Write ``{"state_dict": {"ctx": [M, d_t]}, "epoch": epoch, "n_ctx": M}`` for stock CoOp/CoCoOp
    ``MODEL.INIT_WEIGHTS``, atomically; plain tensors and ints (``torch.load(..., weights_only=True)``)."""
    state = {"ctx": ctx.detach().float().cpu().clone()}
    return write_bytes_atomic(path, _saved({"state_dict": state, "epoch": int(epoch), "n_ctx": int(ctx.shape[0])}))


def _saved(obj: Any) -> bytes:
    """``torch.save(obj)``'s bytes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# Where a stock-CoCoOp checkpoint's file sits inside its folder (Dassl's layout: <model>/model.pth.tar-<epoch>).
COCOOP_CHECKPOINT = "prompt_learner/model.pth.tar-{epoch}"


def export_cocoop_checkpoint(directory: Union[str, Path], state: Mapping[str, torch.Tensor], epoch: int = 0) -> Path:
    """Write ``directory/prompt_learner/model.pth.tar-<epoch>`` = ``{"state_dict": state, "epoch": epoch}``: what
    stock CoCoOp's ``load_model(directory, epoch)`` (``train.py --model-dir directory --load-epoch epoch``) and
    ``MODEL.INIT_WEIGHTS <that file>`` read (KaiyangZhou/CoOp ``trainers/cocoop.py``; Dassl's checkpoint layout).

    ``state`` holds CoCoOp's ``PromptLearner`` keys: ``ctx`` ``[M, d_t]`` and ``meta_net.linear1.weight``
    ``[h, E]``, ``.bias`` ``[h]``, ``meta_net.linear2.weight`` ``[d_t, h]``, ``.bias`` ``[d_t]``, stored float32,
    written atomically."""
    if "ctx" not in state or not any(k.startswith("meta_net.") for k in state):
        raise ValueError(f"a stock-CoCoOp checkpoint needs ctx and meta_net.* tensors, got {', '.join(sorted(state))}")
    data = _saved({"state_dict": {k: v.detach().float().cpu().clone() for k, v in state.items()}, "epoch": int(epoch)})
    path = Path(directory) / COCOOP_CHECKPOINT.format(epoch=int(epoch))
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_bytes_atomic(path, data)


def cocoop_checkpoint_usage(directory: Union[str, Path], n_ctx: int, epoch: int = 0) -> str:
    """How stock CoCoOp reads :func:`export_cocoop_checkpoint`'s folder: with the prompt-length options (both ways:
    CoCoOp builds its ``ctx`` from them before loading), evaluate it or start training from it."""
    directory = Path(directory).resolve()
    file = directory / COCOOP_CHECKPOINT.format(epoch=int(epoch))
    return (
        f'stock CoCoOp (ctx and meta-net), options TRAINER.COCOOP.N_CTX {int(n_ctx)} TRAINER.COCOOP.CTX_INIT "": '
        f"--model-dir {directory} --load-epoch {int(epoch)} --eval-only, or MODEL.INIT_WEIGHTS {file}"
    )
