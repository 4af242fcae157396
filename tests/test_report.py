"""The tuning report claims only what the study's own noise supports: studies built
in a real (in-memory) Optuna storage with known measurements, a planted outlier
among them, and the report's files read back."""

from __future__ import annotations

import json
import warnings

import optuna
import pytest

from overlapkit.tuning import TuneConfig
from overlapkit.tuning.analysis import Analysis
from overlapkit.tuning.report import report_document, write_report
from overlapkit.tuning.space import build_space

SPACE_OF = {"ddp_overlap": {}, "prefetch": {}}


def study_of(measurements: list[tuple], repeats: int) -> Analysis:
    """``measurements``: (ddp_overlap intensity, prefetch intensity, samples/s), and
    optionally the trial's role (search by default)."""
    tune = TuneConfig(intensity_step=0.5, repeats=repeats, policy=False)
    space = build_space(SPACE_OF, tune)
    study = optuna.create_study(direction="maximize", study_name="planted")
    study.set_user_attr("objectives", ["throughput"])
    study.set_user_attr("tune", tune.model_dump(mode="json"))
    distributions = {
        d.name: optuna.distributions.FloatDistribution(d.low, d.high, step=d.step)
        for d in space.dimensions
    }
    for ddp, prefetch, value, *role in measurements:
        study.add_trial(
            optuna.trial.create_trial(
                params={"ddp_overlap.intensity": ddp, "prefetch.intensity": prefetch},
                distributions=distributions,
                value=value,
                user_attrs={"role": (role or ["search"])[0], "throughput": value, "goodput": value},
            )
        )
    return Analysis.of(study, space)


# The study: one slow baseline run (152.7 against 428.7 on its repeat);
# everything else repeats within about 1 %.
PLANTED = [
    (0.0, 0.0, 428.7),
    (0.0, 0.0, 152.7),  # the outlier
    (0.5, 0.0, 405.0),
    (0.5, 0.0, 409.0),
    (1.0, 0.0, 410.0),
    (1.0, 0.0, 415.0),
    (0.0, 0.5, 300.0),
    (0.0, 0.5, 303.0),
    (0.0, 1.0, 250.0),
    (0.0, 1.0, 252.0),
    (1.0, 1.0, 300.0),
    (1.0, 1.0, 297.0),
    (1.0, 0.5, 412.0),
    (1.0, 0.5, 408.0),
]


def report(analysis: Analysis, folder) -> tuple[dict, str]:
    document = report_document(analysis)
    base = {"name": "planted", "optimizations": SPACE_OF}
    files = write_report(analysis, document, base, folder)
    return json.loads(files["json"].read_text()), files["markdown"].read_text()


def test_a_planted_outlier_is_flagged_and_nothing_is_claimed_from_it(tmp_path):
    analysis = study_of(PLANTED, repeats=2)
    # The noise comes from the settings that repeat well: about 1 %, not the outlier's 2x.
    assert 0.005 < analysis.noise < 0.015
    document, markdown = report(analysis, tmp_path)
    rows = {row["row"]: row for row in document["comparison"]}
    baseline = rows["baseline (all off)"]
    assert baseline["disagree"] and (baseline["low"], baseline["high"]) == (152.7, 428.7)
    assert baseline["measured"] == 2 and baseline["throughput"] == pytest.approx(290.7)
    # ddp_overlap alone looks 1.43x the baseline's median (2.69x against its low run):
    # neither is claimed, and the table says so.
    ddp = rows["ddp_overlap alone"]
    assert ddp["vs_baseline"] == pytest.approx(412.5 / 290.7) and ddp["beyond_noise"] is False
    assert "2.69x" not in markdown and "1.42x (within noise)" in markdown
    assert "| baseline (all off) (!) |" in markdown
    # The warnings: too few repeats, and which rows disagree.
    assert any("tune.repeats is 2" in w for w in document["warnings"])
    assert any("baseline (all off)" in w for w in document["warnings"])
    # No contention point along ddp_overlap: its levels differ by less than the noise
    # (0.5 vs 1) or against a baseline too wild to judge.
    curve = document["curves"]["ddp_overlap"]
    assert curve["flat"] and curve["alone_flat"]
    assert "stops paying beyond ddp_overlap.intensity" not in markdown
    # The best cannot be told apart from its neighbours, and the report names them.
    tied = [t["params"] for t in document["best"]["ties"]]
    assert {"ddp_overlap.intensity": 1.0, "prefetch.intensity": 0.5} in tied or {
        "ddp_overlap.intensity": 1.0,
        "prefetch.intensity": 0.0,
    } in tied
    assert "within noise of it" in markdown
    # The overview: a bar per row with its range, drawn and linked from the report.
    assert (tmp_path / "overview.png").stat().st_size > 10_000 and "(overview.png)" in markdown


def test_differences_beyond_the_noise_are_claimed(tmp_path):
    """The control: the same study without the outlier claims the real differences
    (prefetch costs here, far beyond 1 % noise) and the contention point."""
    clean = [m for m in PLANTED if m[2] != 152.7] + [(0.0, 0.0, 300.0), (0.0, 0.0, 302.0)]
    clean.remove((0.0, 0.0, 428.7))
    analysis = study_of(clean, repeats=2)
    document, markdown = report(analysis, tmp_path)
    rows = {row["row"]: row for row in document["comparison"]}
    assert rows["ddp_overlap alone"]["beyond_noise"] is True  # 412.5 vs 301: 1.37x
    assert "1.37x |" in markdown
    curve = document["curves"]["ddp_overlap"]
    assert not curve["alone_flat"] and curve["alone_point"] == 0.5  # 0.5 ~ 1.0 > 0
    assert "| baseline (all off) |" in markdown  # not flagged
    assert not any("disagree" in w for w in document["warnings"])


def test_with_one_measurement_per_setting_nothing_is_confirmed(tmp_path):
    single = [(d, p, v) for d, p, v in PLANTED[::2]]
    analysis = study_of(single, repeats=1)
    document, markdown = report(analysis, tmp_path)
    assert analysis.noise is None
    assert any("nothing is confirmed" in w for w in document["warnings"])
    assert "confirmed by" not in markdown
    assert "noise unknown" in markdown


def test_a_tiny_study_says_not_measured_and_claims_nothing_beyond_an_unknown_noise(tmp_path):
    """Two trials, neither with ddp_overlap on: the report said 'ddp_overlap.intensity=
    None' for its alone row, 'None' where it stops paying, 'within noise' for a drop
    from one level to itself, and that the best was 'ahead of every other setting
    beyond the noise' under 'noise unknown'."""
    analysis = study_of([(0.0, 0.5, 403.1), (0.0, 1.0, 380.0)], repeats=1)
    document, markdown = report(analysis, tmp_path)
    assert analysis.noise is None and "None" not in markdown, markdown
    assert "beyond the noise" not in markdown.split("best: trial", 1)[1].split("\n", 1)[0]
    assert "ahead of every other setting by over 2 % (the noise is unknown)" in markdown
    (ddp,) = [line for line in markdown.splitlines() if line.startswith("| ddp_overlap |")]
    assert "not measured" in ddp and "within noise" not in ddp, ddp


def test_repeats_of_one_with_a_setting_the_search_ran_twice_says_where_its_noise_is_from(
    tmp_path,
):
    """tune.repeats 1, and the search sampled one setting twice: the warning said the
    noise was unknown while the table gave one from that setting."""
    twice = [(d, p, v) for d, p, v in PLANTED[::2]] + [PLANTED[3]]  # (0.5, 0) again
    analysis = study_of(twice, repeats=1)
    document, _ = report(analysis, tmp_path)
    assert analysis.noise is not None
    said = [w for w in document["warnings"] if w.startswith("tune.repeats is 1")]
    assert said and "the noise is unknown" not in said[0]
    assert "happened to run twice" in said[0]


def test_a_study_cut_short_is_reported_as_unfinished(tmp_path):
    analysis = study_of(PLANTED, repeats=2)
    document, _ = report(analysis, tmp_path)
    assert not [w for w in document["warnings"] if "unfinished" in w]
    analysis.study.enqueue_trial({"ddp_overlap.intensity": 0.5, "prefetch.intensity": 1.0})
    document, markdown = report(analysis, tmp_path)
    assert any(
        "the study is unfinished: 1 trial(s) running or queued" in w for w in document["warnings"]
    )
    assert "unfinished" in markdown


def test_a_point_with_no_level_measured_above_it_is_not_called_a_contention_point(tmp_path):
    """ddp_overlap measured at 0 and 0.5 only (1.0 never ran): its best is the highest
    level measured, so nothing says more overlap stops paying there (the report
    said so: 1.0 might pay more)."""
    from rich.console import Console

    from overlapkit.tuning.report import print_report

    measured = [(0.0, 0.0, 300.0), (0.0, 0.0, 302.0), (0.5, 0.0, 400.0), (0.5, 0.0, 404.0)]
    measured += [(0.0, 0.5, 250.0), (0.0, 0.5, 252.0), (0.5, 0.5, 350.0), (0.5, 0.5, 352.0)]
    analysis = study_of(measured, repeats=2)
    document, markdown = report(analysis, tmp_path)
    curve = document["curves"]["ddp_overlap"]
    assert curve["contention_point"] == 0.5 and curve["unmeasured_above"] == [1.0]
    assert "| not measured above 0.5 |" in markdown
    console = Console(record=True, width=200)
    print_report(document, {"markdown": tmp_path / "report.md", "html": tmp_path / "r"}, console)
    said = console.export_text()
    assert "stops paying beyond ddp_overlap.intensity=0.5" not in said
    assert (
        "best at ddp_overlap.intensity=0.5, the highest level measured (1.0 not measured)" in said
    )


def test_a_curve_still_rising_at_the_top_of_the_range_has_no_contention_point(tmp_path):
    """ddp_overlap best at 1.0, the highest level there is, and every lower level worse
    beyond the noise: the report said 'more overlap stops paying beyond 1.0' (and drew a
    contention point there) for a curve still climbing at the top of its range."""
    from rich.console import Console

    from overlapkit.tuning.report import print_report

    measured = [(0.0, 0.0, 300.0), (0.0, 0.0, 302.0), (0.5, 0.0, 350.0), (0.5, 0.0, 352.0)]
    measured += [(1.0, 0.0, 400.0), (1.0, 0.0, 404.0), (1.0, 0.5, 380.0), (1.0, 0.5, 381.0)]
    measured += [(1.0, 1.0, 360.0), (1.0, 1.0, 362.0)]
    document, markdown = report(study_of(measured, repeats=2), tmp_path)
    curve = document["curves"]["ddp_overlap"]
    assert curve["contention_point"] == 1.0 and curve["at_top"]
    assert "| not in the range: best at its top, 1.0 |" in markdown
    console = Console(record=True, width=200)
    print_report(document, {"markdown": tmp_path / "report.md", "html": tmp_path / "r"}, console)
    said = console.export_text()
    assert "stops paying beyond ddp_overlap.intensity=1.0" not in said
    assert "best at ddp_overlap.intensity=1.0, the top of the range searched" in said
    # prefetch peaks at 0 and falls beyond the noise: a contention point as before.
    assert not document["curves"]["prefetch"]["at_top"]


def test_a_contention_point_below_the_peak_names_the_peak(tmp_path):
    """The lowest level within the noise of the peak is the contention point; the peak
    (0.5) was not named, so 'stops paying beyond 0.0' read as contradicting the curve."""
    from rich.console import Console

    from overlapkit.tuning.report import print_report

    measured = [(0.0, 0.0, 330.0), (0.0, 0.0, 420.0), (0.5, 0.0, 400.0), (0.5, 0.0, 404.0)]
    measured += [(1.0, 0.0, 300.0), (1.0, 0.0, 301.0), (0.0, 0.5, 250.0), (0.0, 0.5, 251.0)]
    document, _ = report(study_of(measured, repeats=2), tmp_path)
    curve = document["curves"]["ddp_overlap"]
    assert curve["contention_point"] == 0.0 and curve["peak"] == 0.5
    console = Console(record=True, width=200)
    print_report(document, {"markdown": tmp_path / "report.md", "html": tmp_path / "r"}, console)
    assert "(its peak, at 0.5, is within the noise of 0.0)" in console.export_text()


def test_the_analysis_phase_repeats_do_not_move_the_center_its_curves_were_measured_at(
    tmp_path,
):
    """The analysis phase sweeps each level around the search's best (1.0, 0.5). Its
    repeats of a sweep point the search had also measured, (0.5, 0.5), raised that
    setting's median above the center's, so the report took it as the center: its
    prefetch curve 'with the others' then had one point and said 'not measured above
    0.5', while the sweep around the real center had measured 0, 0.5 and 1."""
    from rich.console import Console

    from overlapkit.tuning.report import print_report

    measured = [(1.0, 0.5, 400.0), (1.0, 0.5, 402.0), (0.5, 0.5, 390.0), (0.5, 0.5, 391.0)]
    measured += [(0.0, 0.0, 300.0), (0.0, 0.0, 301.0)]
    for ddp, prefetch, value in [(0.0, 0.5, 350.0), (0.5, 0.5, 450.0), (0.5, 0.5, 452.0)]:
        measured.append((ddp, prefetch, value, "sweep:ddp_overlap"))
    for ddp, prefetch, value in [(1.0, 0.0, 380.0), (1.0, 1.0, 360.0), (1.0, 1.0, 361.0)]:
        measured.append((ddp, prefetch, value, "sweep:prefetch"))
    document, markdown = report(study_of(measured, repeats=2), tmp_path)
    assert document["center"]["params"] == {"ddp_overlap.intensity": 1.0, "prefetch.intensity": 0.5}
    assert [level for level, _ in document["curves"]["prefetch"]["with_others"]] == [0.0, 0.5, 1.0]
    assert document["curves"]["prefetch"]["unmeasured_above"] == []
    # The analysis found a better setting: it is the tuned best, not the center.
    assert document["best"]["params"] == {"ddp_overlap.intensity": 0.5, "prefetch.intensity": 0.5}
    assert "| prefetch | prefetch.intensity | not measured above 0.5 | 0.5 | -10% |" in markdown
    # The terminal's contention lines say which curves they read.
    console = Console(record=True, width=200)
    print_report(document, {"markdown": tmp_path / "report.md", "html": tmp_path / "r"}, console)
    said = console.export_text()
    assert "each with the others at the tuned best (trial 0):\nddp_overlap:" in said


def test_the_best_setting_of_a_study_over_machines_is_run_on_a_cluster(tmp_path):
    """Its command says --ray (run without it, a scenario of two machines is refused)."""
    analysis = study_of(PLANTED, repeats=2)
    document = report_document(analysis)
    base = {"name": "planted", "optimizations": SPACE_OF, "world": {"nodes": 2}}
    files = write_report(analysis, document, base, tmp_path)
    assert f"# Run it: overlapkit run {files['best']} --ray ADDRESS" in files["best"].read_text()
    assert f"overlapkit run {files['best']} --ray ADDRESS" in files["markdown"].read_text()


def curve_points(levels_values: list[tuple[object, list[float]]]) -> list[dict]:
    points = [
        {
            "level": level,
            "median": sorted(values)[len(values) // 2],
            "low": min(values),
            "high": max(values),
            "n": len(values),
            "disagree": False,
            "values": sorted(values),
        }
        for level, values in levels_values
    ]
    first = points[0]["median"]  # relative to the first level met, with the range's bounds
    for p in points:
        p["relative"] = [p["median"] / first, p["low"] / first, p["high"] / first]
    return points


def test_contention_curves_are_relative_with_ranges_and_never_join_categories():
    from overlapkit.tuning.plots import contention, ordered_levels, plt

    assert ordered_levels([8, "off", 2, "fp16", 0.5]) == ["off", 0.5, 2, 8, "fp16"]
    # A checkpoint panel: off, then every 8 and every 2 (in the order the study met them).
    alone = curve_points([("off", [10.0, 11.0]), (8, [30.0, 33.0]), (2, [20.0])])
    together = curve_points([(2, [400.0, 420.0]), ("off", [500.0, 510.0]), (8, [450.0])])
    curve = {
        "level": "checkpoint.every",
        "points": {"alone": alone, "with_others": together},
        "contention_point": 8,
        "flat": False,
    }
    fig = contention({"checkpoint": curve}, "goodput")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["off", "2", "8"]
    # Each series is an errorbar container whose bars span the repeats' range...
    containers = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(containers) == 2
    xs, ys = containers[0].lines[0].get_data()  # alone: relative to its value off
    assert list(ys) == pytest.approx([1.0, 20.0 / 11.0, 33.0 / 11.0])  # off, 2, 8
    # ...and a joining line only runs between numeric levels (2 and 8), never from off.
    joined = [
        line
        for line in ax.get_lines()
        if line.get_linestyle() == "-" and line.get_color() in ("tab:blue", "tab:orange")
    ]
    assert joined  # the numeric levels are joined
    off = 0  # the x position of "off"
    for line in joined:
        assert all(abs(x - off) > 0.5 for x in line.get_xdata())
        assert sorted(line.get_xdata()) == list(line.get_xdata())  # 2 then 8, left to right
    plt.close(fig)


def test_the_terminal_table_fits_80_columns_without_cutting_names(tmp_path):
    from rich.console import Console

    from overlapkit.tuning.report import comparison_table

    document, _ = report(study_of(PLANTED, repeats=2), tmp_path)
    console = Console(width=80, record=True)
    console.print(comparison_table(document))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "…" not in text  # nothing truncated
    cells = " ".join(line.split("│")[-2].strip() for line in text.splitlines() if "│" in line)
    # Knobs abbreviated the same way in every row, each name whole.
    assert "ddp_overlap 1, prefetch 0" in cells.replace("  ", " ")
    assert "1.42x" in text and "~" in text  # the ratio and its within-noise mark


def test_goodput_that_counts_untaken_checkpoints_as_free_is_named(tmp_path):
    # Trials 1 and 2 checkpoint too rarely to take one within the trial: their
    # throughput lacks the checkpoints' cost.
    analysis = study_of(PLANTED[:4], repeats=2)
    analysis.metric, analysis.objectives = "goodput", ["goodput"]
    for measurement, taken in zip(analysis.measured, [None, 0, 0, 3], strict=True):
        measurement.attrs["checkpoints"] = taken
    document, markdown = report(analysis, tmp_path)
    warning = next(w for w in document["warnings"] if "no checkpoint" in w)
    assert warning.startswith("trials 1, 2 took no checkpoint in their 15 steps")
    assert "tune.steps" in warning and warning in markdown
    analysis.metric, analysis.objectives = "throughput", ["throughput"]  # not a goodput claim
    assert not any("no checkpoint" in w for w in report_document(analysis)["warnings"])


def test_a_metric_at_zero_everywhere_is_plotted_without_a_warning(tmp_path):
    """Every row at 0 (as goodput is when the MTBF is far below the job) set the
    overview's axis to (0, 0): matplotlib's UserWarning reached the terminal."""
    zeros = [(d, p, 0.0) for d, p, _ in PLANTED]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, markdown = report(study_of(zeros, repeats=2), tmp_path)
    assert (tmp_path / "overview.png").stat().st_size > 10_000 and "(overview.png)" in markdown


def test_studies_side_by_side_give_the_best_settings_median_as_its_report_does():
    """The best of two measurements (410 and 415) is their median, 412.5, as in the
    study's own report and in the ratios beside it (compare said 410: one trial)."""
    from overlapkit.tuning.compare import compare_document

    analysis = study_of(PLANTED, repeats=2)
    tuned = {row["row"]: row for row in analysis.comparison()}["tuned best"]
    best = compare_document([("planted", analysis)])["studies"][0]["best"]
    assert best["value"] == pytest.approx(tuned["throughput"]) == pytest.approx(412.5)


def test_a_knob_no_measured_trial_varied_gets_no_importance():
    """prefetch held at 0 in every trial: Optuna's PED-ANOVA still ranked it first
    (tied with another that never varied), above the knob that did vary."""
    measured = [(0.0, 0.0, 300.0), (0.0, 0.0, 302.0), (0.5, 0.0, 400.0), (0.5, 0.0, 404.0)]
    measured += [(1.0, 0.0, 350.0), (1.0, 0.0, 352.0)]
    importances = study_of(measured, repeats=2).importances()
    assert "prefetch.intensity" not in importances
    assert importances == {"ddp_overlap.intensity": pytest.approx(1.0)}


def test_a_curve_with_nothing_measured_is_drawn_without_a_warning():
    """A study whose every trial failed: its contention plot printed matplotlib's 'No
    artists with labels found to put in legend' on the user's terminal, once a curve."""
    from overlapkit.tuning.plots import contention

    empty = {
        "level": "pipeline.intensity",
        "points": {"alone": [], "with_others": []},
        "contention_point": None,
        "flat": False,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = contention({"pipeline": empty}, "throughput")
    assert fig.axes[0].get_legend() is None


def test_the_plots_legends_hide_no_point_and_trials_are_whole_numbers(tmp_path):
    """Each contention plot had a legend of its own inside its axes, over the curves'
    top points, and the history of a short study had ticks at trial 0.25, 0.5, ...:
    one legend now sits under the plots, and the history's ticks are whole."""
    from overlapkit.tuning.plots import contention, history

    analysis = study_of(PLANTED[:4], repeats=2)
    fig = contention(report_document(analysis)["curves"], "throughput")
    assert [ax.get_legend() for ax in fig.axes] == [None, None]
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "alone (the others off)",
        "with the others at the tuned best",
    ]
    ticks = history(analysis).axes[0].get_xticks()
    assert len(ticks) > 1 and all(float(t).is_integer() for t in ticks)


def test_a_study_keeps_its_colour_in_every_compare_plot(tmp_path, monkeypatch):
    """Each plot took colours in turn from the studies it drew: a study without a curve
    for prefetch left the next one blue there, while the one legend said blue was the
    first study."""
    import matplotlib.colors as colors

    from overlapkit.tuning import compare

    def study(label, curves):
        return {"label": label, "hardware": "cpu", "metric": "throughput", "curves": curves}

    one = [(0.0, 100.0), (1.0, 120.0)]
    document = {
        "optimizations": ["ddp_overlap", "prefetch"],
        "studies": [
            study("a", {"ddp_overlap": one}),
            study("b", {"ddp_overlap": one, "prefetch": one}),
        ],
    }
    drawn = {}
    monkeypatch.setattr(compare, "save_figure", lambda fig, path: drawn.setdefault("fig", fig))
    compare._plot(document, tmp_path / "compare.png")
    ddp, prefetch = drawn["fig"].axes
    colour = lambda line: colors.to_hex(line.get_color())  # noqa: E731
    assert [colour(line) for line in ddp.lines] == [colors.to_hex("C0"), colors.to_hex("C1")]
    assert [colour(line) for line in prefetch.lines] == [colors.to_hex("C1")]


def test_the_history_does_not_call_one_lucky_trial_the_best_and_the_front_is_named(tmp_path):
    """The history's line is the highest single measurement (a lucky one can lead it)
    while the report's best is a median: it was labelled "best so far". The Pareto
    front's points did not say which trials they were."""
    from overlapkit.tuning.plots import history, pareto

    analysis = study_of(PLANTED[:4], repeats=2)
    labels = [t.get_text() for t in history(analysis).axes[0].get_legend().get_texts()]
    assert labels == ["trial", "highest single trial so far"]
    analysis.objectives = ["throughput", "goodput"]
    front = analysis.pareto()
    texts = [t.get_text() for t in pareto(analysis).axes[0].texts]
    assert front and texts == [f"#{m.number}" for m in front]
