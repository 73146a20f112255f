"""The golden numerics fingerprint: a digest of a short, fixed meta-training + fine-tuning run.

For every learner of the method table (CoOp, VPT, UNIGRAM, IVLP, MaPLe: :data:`LEARNERS`) and both task loops
(``sequential``: one task after another; ``stacked``: the meta-batch as one pass, :mod:`meta.method.batched`) it runs,
on the 3.4 M-parameter test CLIP (``GRAM-Test-Tiny``, random weights from a fixed seed) and fixed synthetic tasks:

``OUTER_STEPS`` second-order outer steps of :class:`meta.method.gram.GRAMMetaLearner` (θ and R_φ), then
``FINETUNE_STEPS`` regulated SGD steps from θ* with the meta-learned R_φ (``RegulatedStepper``, momentum 0.9, as at
test time), and hashes every bit that comes out: each outer loss, θ* and φ, the fine-tuning losses and the fine-tuned
θ (float32/float64 bytes, SHA-256).  One digest per (learner, loop) and one over all of them.

``meta/fingerprint/golden.json`` holds the digests under the numerics pins; ``python -m meta.fingerprint --check``
compares (one last bit anywhere gives another digest), ``--write`` replaces the file (only when numbers are meant to
move), ``--perturb-ulp`` moves one element of the start θ by one ulp.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from meta.method import methods

GOLDEN = Path(__file__).with_name("golden.json")
MODEL = "GRAM-Test-Tiny"
OUTER_STEPS = 3
FINETUNE_STEPS = 3
WAY, SUPPORT_SHOTS, QUERY_SHOTS, TASKS = 3, 1, 2, 2
LOOPS = {"sequential": "off", "stacked": "on"}
# learner -> PromptSpec fields: every learner of the method table in its reference shape on the 2-layer test CLIP
# (deep learners prompt every layer), in table order; the names key the digests' runs (meta/method/methods.yaml)
LEARNERS: dict[str, dict] = methods.learner_shapes("tiny")


def _bytes(value) -> bytes:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous().numpy().tobytes()
    return repr(value).encode()


class _Digest:
    def __init__(self) -> None:
        self.sha = hashlib.sha256()

    def add(self, name: str, value) -> None:
        self.sha.update(name.encode() + b"\0" + _bytes(value) + b"\0")

    def hex(self) -> str:
        return self.sha.hexdigest()


def _tasks(dims, images: bool, device: torch.device):
    from meta.method.gram import TaskBatch

    gen = torch.Generator().manual_seed(7)
    names = [f"object {i}" for i in range(WAY)]

    def part(shots: int) -> dict:
        out = {"classnames": names, "label": torch.arange(WAY).repeat(shots).to(device)}
        if images:
            out["images"] = torch.randn(WAY * shots, 3, dims.image_size, dims.image_size, generator=gen).to(device)
        else:
            feats = torch.randn(WAY * shots, dims.embed_dim, generator=gen)
            out["features"] = torch.nn.functional.normalize(feats, dim=-1).to(device)
        return out

    return [TaskBatch(part(SUPPORT_SHOTS), part(QUERY_SHOTS)) for _ in range(TASKS)]


def run_one(learner: str, loop: str, perturb_ulp: bool = False) -> str:
    """Digest (SHA-256 hex) of ``learner``'s meta-training + fine-tuning run with the ``loop`` task loop."""
    import logging
    import warnings

    from meta.finetune.regulated import GradientRegulation, RegulatedStepper
    from meta.metatrain.outer import OuterStep
    from meta.method.gram import GRAMMetaLearner, MetaSpec
    from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
    from meta.model.backbone import load_clip

    device = torch.device("cpu")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "random weights" is the point here (open_clip also logs it)
        logging.disable(logging.WARNING)
        try:
            clip, dims = load_clip(MODEL, pretrained=None, device=device)
        finally:
            logging.disable(logging.NOTSET)
    spec = PromptSpec(**LEARNERS[learner])
    theta = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(1))
    if perturb_ulp:
        with torch.no_grad():
            first = next(p for p in theta.parameters())
            flat = first.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
    digest = _Digest()
    for name, p in theta.named_parameters():
        digest.add(f"start.{name}", p)
    ml = GRAMMetaLearner(theta, MetaSpec(first_order=False, task_batching=LOOPS[loop])).to(device)
    outer = OuterStep(ml)
    loss_fn = classification_loss(PromptedCLIP(clip, dims, theta.n_ctx_text, template=spec.template))
    tasks = _tasks(dims, spec.has_visual_prompts, device)
    for step in range(OUTER_STEPS):
        stats = outer.meta_step(tasks, loss_fn)
        digest.add(f"outer{step}.loss", float(stats["query_loss_after"]))
    for name, p in ml.prompt_module.named_parameters():
        digest.add(f"theta_star.{name}", p)
    for name, reg in ml.regulators().items():
        for pname, p in reg.named_parameters():
            digest.add(f"phi.{name}.{pname}", p)
    # fine-tuning from θ* with the meta-learned R_φ on the first task's support, as at test time
    import copy

    tuned = copy.deepcopy(ml.prompt_module)
    for p in tuned.parameters():
        p.requires_grad_(True)
    optimizer = torch.optim.SGD(list(tuned.parameters()), lr=0.002, momentum=0.9)
    stepper = RegulatedStepper(tuned, optimizer, GradientRegulation(ml.regulators()))
    support = tasks[0].support
    for step in range(FINETUNE_STEPS):
        loss, _ = loss_fn(tuned, support)
        digest.add(f"finetune{step}.loss", loss)
        stepper.backward(loss)
    for name, p in tuned.named_parameters():
        digest.add(f"tuned.{name}", p)
    return digest.hex()


def fingerprint(perturb_ulp: bool = False, learners=tuple(LEARNERS), loops=tuple(LOOPS)) -> dict:
    """``{"runs": {"<learner>/<loop>": digest}, "digest": digest over all runs}``.

    Runs on one torch thread and leaves the caller's thread count and global RNG state as they were."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's global RNG stream is left as it was
            runs = {f"{lr}/{lp}": run_one(lr, lp, perturb_ulp) for lr in learners for lp in loops}
    finally:
        torch.set_num_threads(threads)
    total = hashlib.sha256(json.dumps(runs, sort_keys=True).encode()).hexdigest()
    return {"digest": total, "runs": runs}


def compare(found: dict, golden: dict) -> list[str]:
    """The ``learner/loop`` runs whose digests differ from ``golden`` (empty: the fingerprint holds)."""
    keys = sorted(set(found["runs"]) | set(golden["runs"]))
    return [k for k in keys if found["runs"].get(k) != golden["runs"].get(k)]
