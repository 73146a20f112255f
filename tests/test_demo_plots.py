"""The demo's plots read without the code: plain row names, no zero-width error bars for one seed, overlapping lines
said, the warm-up note clear of other text, short Fig. 3b series drawn as points with their count (no training;
seconds, matplotlib's Agg backend)."""

import json
import statistics
from dataclasses import replace
from types import SimpleNamespace

import matplotlib
import matplotlib.image
import matplotlib.pyplot
import pytest
from matplotlib.container import ErrorbarContainer

from gram_world.demo import METHOD_BY_KEY, TABLE4_KEYS, DemoSettings, report
from gram_world.demo.settings import EPOCH_CURVE_KEYS, TABLE1_ROWS, TRANSFER_KEYS, variants_needed
from meta.data.coop_data import harmonic_mean

matplotlib.use("Agg")  # as the demo's plots() does

SKETCH, FAMILY = "WorldASketch", ("WorldP", "WorldQ")


class _KeepFigures:
    """``matplotlib.pyplot`` whose ``close`` keeps the figure, so a test can read what was drawn."""

    def __init__(self):
        self.figures = []

    def __getattr__(self, name):
        return getattr(matplotlib.pyplot, name)

    def close(self, fig):
        self.figures.append(fig)


def _world():
    roles = {"cross_domain_target": [SKETCH], "cross_dataset_target": list(FAMILY)}
    return SimpleNamespace(
        settings_hash="0123456789ab",
        with_role=lambda role: [SimpleNamespace(name=n) for n in roles.get(role, [])],
    )


def _settings(seeds):
    return replace(DemoSettings(), seeds=tuple(seeds), tables=("base2new", "ablations", "transfer"), quick=True)


def _b2n(seeds, same_as=None):
    """Base-to-new records of every Table 1 / Table 4 row, with per-epoch histories for Fig. 3a; ``same_as``:
    ``{key: other key}`` rows whose accuracies (and curves) equal the other row's."""
    same_as = same_as or {}
    keys = list(dict.fromkeys(TABLE1_ROWS + TABLE4_KEYS))
    out = []
    for i, key in enumerate(keys):
        j = keys.index(same_as.get(key, key))
        for seed in seeds:
            base, new = 40 + j + seed, 30 + 0.5 * j - seed
            history = [
                {"epoch": e, "base": base - 3 + e, "new": new + e / 2, "H": harmonic_mean(base - 3 + e, new + e / 2)}
                for e in range(4)
            ]
            out.append(
                {
                    "protocol": "base2new",
                    "dataset": "WorldA",
                    "key": key,
                    "method": METHOD_BY_KEY[key].label,
                    "seed": seed,
                    "base": base,
                    "new": new,
                    "H": harmonic_mean(base, new),
                    "history": history if key in EPOCH_CURVE_KEYS else [],
                }
            )
    return out


def _transfer(seeds):
    out = []
    for i, key in enumerate(TRANSFER_KEYS):
        for seed in seeds:
            targets = {SKETCH: 20 + i + seed, FAMILY[0]: 50 + seed, FAMILY[1]: 60 - seed}
            out += [
                {
                    "protocol": "transfer",
                    "dataset": "WorldA",
                    "key": key,
                    "method": METHOD_BY_KEY[key].label,
                    "seed": seed,
                    "shots": shots,
                    "source": 70 + i - seed,
                    "targets": targets,
                    "target_mean": statistics.fmean(targets.values()),
                    "history": [],
                }
                for shots in (4, 1)
            ]
    return out


def _draw(kind, seeds, tmp_path, same_as=None):
    """The figure of plot ``kind`` ("bars", "transfer", "epochs") over ``seeds``."""
    settings, world = _settings(seeds), _world()
    records = _b2n(seeds, same_as) + _transfer(seeds)
    tables = report.build_tables(records, replace(settings, transfer_shots=(4, 1)), world)
    plt = _KeepFigures()
    path = tmp_path / f"{kind}.png"
    if kind == "bars":
        report._bars(tables, settings, world, path, plt)
    elif kind == "transfer":
        report._transfer_bars(tables, settings, world, path, plt)
    else:
        report._epochs(records, settings, world, path, plt)
    assert matplotlib.image.imread(path).shape[2] in (3, 4)  # a PNG was written and reads back
    return plt.figures[0]


def _titles(fig):
    """The figure's title and its axes' titles, one string."""
    return " ".join([fig._suptitle.get_text() if fig._suptitle else ""] + [ax.get_title() for ax in fig.axes])


def _texts(fig):
    return [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text()]


def test_plots_name_table_4_rows_plainly_where_the_tables_keep_the_papers_names(tmp_path):
    assert METHOD_BY_KEY["unigram_no_reg"].label == "- gradient regulating"  # the table's row name stays
    for key in TABLE4_KEYS:
        assert not report.plot_label(key).startswith("-"), key
    assert report.plot_label("unigram_no_reg") == "UNIGRAM, no R_φ (θ* meta-trained and tuned without it)"
    fig = _draw("bars", (1, 2, 3), tmp_path)
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert "UNIGRAM, no R_φ (θ* meta-trained and tuned without it)" in ticks
    assert not [t for t in _texts(fig) if t.startswith("- ")]
    transfer = _draw("transfer", (1, 2, 3), tmp_path)
    assert not [t for t in _texts(transfer) if t.startswith("- ")]


@pytest.mark.parametrize("kind", ["bars", "transfer"])
def test_one_seed_draws_no_error_bars_and_says_1_seed(tmp_path, kind):
    one = _draw(kind, (1,), tmp_path)
    assert not [c for ax in one.axes for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert "1 seed, so no error bars" in _titles(one)
    three = _draw(kind, (1, 2, 3), tmp_path)
    assert [c for ax in three.axes for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert "mean ± std over 3 seeds" in _titles(three)


def test_a_line_drawn_over_another_says_so_and_keeps_its_own_marker(tmp_path):
    fig = _draw("epochs", (1,), tmp_path, same_as={"gram_vpt": "vpt"})
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    hidden = [t for t in legend if t.startswith("VPT + GRAM")]
    assert hidden == ["VPT + GRAM\n(lines overlap: same values as VPT)"]
    assert sum("overlap" in t for t in legend) == 1
    lines = {ln.get_label().split("\n")[0]: ln for ln in fig.axes[0].get_lines() if not ln.get_label().startswith("_")}
    assert lines["VPT + GRAM"].get_marker() != lines["VPT"].get_marker()
    assert lines["VPT + GRAM"].get_linestyle() != lines["VPT"].get_linestyle()
    apart = _draw("epochs", (1,), tmp_path)
    assert len([ln for ln in apart.axes[1].get_lines() if not ln.get_label().startswith("_")]) == 6  # 5 + CLIP
    assert not [t for t in apart.axes[1].get_legend().get_texts() if "overlap" in t.get_text()]


def test_the_warm_up_note_is_in_the_axis_label_clear_of_other_text(tmp_path):
    fig = _draw("epochs", (1, 2), tmp_path)
    for ax in fig.axes:
        assert not [t for t in ax.texts if "warm-up" in t.get_text()]  # no note inside the axes
        assert "warm-up at lr 1e-5" in ax.get_xlabel()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]
    notes = [t for t in texts if "warm-up" in t.get_text()]
    assert len(notes) == 2
    for note in notes:
        box = note.get_window_extent(renderer)
        others = [t for t in texts if t is not note and t.get_window_extent(renderer).overlaps(box)]
        assert not others, [t.get_text() for t in others]


def _write_logs(out, steps):
    for variant in variants_needed(("base2new",)):
        folder = out / "meta" / variant.name
        folder.mkdir(parents=True)
        rows = [{"kind": "train", "step": s, "grad_cosine": 0.1 * s} for s in range(1, steps + 1)]
        (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("steps", [2, 6])
def test_a_short_grad_cosine_series_is_drawn_as_points_with_its_step_count(tmp_path, steps):
    _write_logs(tmp_path, steps)
    settings, plt = replace(_settings((1,)), tables=("base2new",)), _KeepFigures()
    data = report._grad_cosine(tmp_path, settings, _world(), tmp_path / "g.png", plt)
    assert matplotlib.image.imread(tmp_path / "g.png").ndim == 3
    ax = plt.figures[0].axes[0]
    lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
    assert len(lines) == len(data["series"]) >= 2
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    if steps == 2:
        assert all(t.endswith("(2 logged steps)") for t in legend), legend
        assert all(ln.get_marker() not in (".", "None", None) and ln.get_markersize() >= 8 for ln in lines)
        assert "; 2 logged step(s) per run" in ax.get_title()
    else:
        assert not [t for t in legend if "logged step" in t] and {ln.get_marker() for ln in lines} == {"."}
    assert not [t for t in legend if t.startswith("- ")]
