"""experiments/hop_overhead.py's rule for a figure that is a difference (Note [Not measured]): a
hop below zero, or one whose interleaved rounds spread over more than itself, is "not measured"
in the JSON row, the printed tables and the plot, never a figure. Pure functions, no processes."""
from __future__ import annotations

import pytest

from experiments import hop_overhead as ho

SHAPE = (1, 256, 56, 56)


def test_a_steady_positive_difference_is_a_figure():
    fig = ho.rounds_figure([0.40, 0.45, 0.42])
    assert fig == {"median": 0.42, "low": 0.40, "high": 0.45, "rounds": 3, "why": None}


def test_a_difference_below_zero_is_not_measured():
    fig = ho.rounds_figure([-1.2, -1.278, -1.4])  # the 103 MB hop a loaded 2-core machine printed
    assert fig["median"] is None and "below zero" in fig["why"]
    assert (fig["low"], fig["high"]) == (-1.4, -1.2)  # the spread is still reported


def test_a_difference_spread_wider_than_itself_is_not_measured():
    fig = ho.rounds_figure([0.1, 0.5, -0.3])  # median 0.1, rounds over 0.8 ms
    assert fig["median"] is None and "spread over 0.800 ms" in fig["why"]
    # the hop stamped inside the blocks: its spread is reported, only a negative one refused
    assert ho.rounds_figure([0.1, 0.5, -0.3], spread_rule=False)["median"] == 0.1
    assert ho.rounds_figure([-0.1, -0.5, 0.3], spread_rule=False)["median"] is None
    # one round has no spread to judge by: only its sign counts
    assert ho.rounds_figure([0.3])["median"] == 0.3
    assert ho.rounds_figure([])["median"] is None


def _rounds(short, long_, hop_ms, inf_ms=0.01, n=5):
    """Rounds of paired round trips (ms) and the stamps of a chain of 4 whose middle hops take
    ``hop_ms[i]`` in round i (t_out - previous t_out - inf)."""
    out = []
    for s, l, h in zip(short, long_, hop_ms):
        hops = []
        for _ in range(n):
            t = 100.0
            rec = [{"t_out": t}]
            for _ in range(3):
                t += (h + inf_ms) / 1e3
                rec.append({"t_out": t, "inf": inf_ms, "t_in": t - 1e-5})
            hops.append(rec)
        out.append(([s] * n, [l] * n, hops))
    return out


def test_rows_tables_and_plot_say_not_measured(tmp_path, capsys):
    # the long chain answered faster than the short one: a negative round-trip difference
    noisy = ho._row("tensormq", "identity", SHAPE, "cpu", 4, _rounds([2.0, 2.1, 2.2], [1.0, 1.1, 0.9],
                                                                       [0.40, 0.42, 0.41]))
    assert noisy["per_hop_paired_median_ms"] is None and noisy["per_hop_median_ms"] is None
    assert noisy["per_hop_p99_ms"] is None
    assert "below zero" in noisy["not_measured"]["per_hop_paired_median_ms"]
    assert noisy["hop_median_ms"] == pytest.approx(0.41)  # the stamps' hop is steady: a figure
    assert noisy["hop_median_spread_ms"] == pytest.approx([0.40, 0.42])
    floor = ho._row("tensormq", "floor", SHAPE, "cpu", 4, _rounds([1.0] * 3, [1.3] * 3, [0.10, 0.12, 0.11]))
    # round trips spread wider than their difference; the stamps' hop below zero (inf larger than the gap)
    spread = ho._row("tensormq", "copy", SHAPE, "cpu", 4, _rounds([1.0, 1.0, 1.0], [1.2, 2.9, 1.3],
                                                                    [-0.05, -0.02, 0.01]))
    assert spread["per_hop_paired_median_ms"] is None
    assert "spread over" in spread["not_measured"]["per_hop_paired_median_ms"]
    assert spread["hop_median_ms"] is None and "below zero" in spread["not_measured"]["hop_median_ms"]
    wide = ho._row("tensormq", "identity", SHAPE, "cpu", 4, _rounds([1.0] * 3, [2.0] * 3, [0.2, 0.9, 0.3]))
    assert wide["hop_median_ms"] == pytest.approx(0.3) and wide["hop_median_spread_ms"] == pytest.approx([0.2, 0.9])
    spread["transport_ms"] = spread["hop_median_ms"]
    rows = [floor, noisy, spread]
    ho.vs_floor(rows)
    # per round: 0.40/0.10, 0.42/0.12, 0.41/0.11 -> the median of the ratios, and their range
    assert noisy["vs_floor"] == pytest.approx(0.41 / 0.11)
    assert noisy["vs_floor_spread"] == pytest.approx([0.42 / 0.12, 0.40 / 0.10])
    assert spread["vs_floor"] is None
    ho._print(noisy)
    ho._print(spread)
    printed = capsys.readouterr().out
    assert "round-trip difference not measured" in printed and "hop median not measured" in printed
    table = ho.summary(rows)
    line = next(x for x in table.splitlines() if x.startswith("| 1x256x56x56"))
    assert "not measured" in line and "3.73x (3.50-4.00)" in line and "-0." not in line
    pytest.importorskip("matplotlib")
    floor["transport_ms"] = floor["hop_median_ms"]
    noisy["transport_ms"] = noisy["hop_median_ms"]
    ho.plot(rows, str(tmp_path))  # the copy row, not measured, is left out instead of failing the plot
    assert (tmp_path / "hop_overhead.png").stat().st_size > 0
