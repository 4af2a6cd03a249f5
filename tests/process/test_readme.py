"""The README's figures are generated from the committed results, never copied by hand."""
import subprocess
import sys

from conftest import ROOT


def test_readme_figures_are_what_the_results_say():
    # experiments/summary.py renders every <!-- summary:NAME --> section from experiments/results/
    proc = subprocess.run([sys.executable, "-m", "experiments.summary", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_a_changed_figure_is_caught(tmp_path):
    # the check is not vacuous: a README whose generated table was edited by hand fails it
    sys.path.insert(0, ROOT)
    from experiments import summary
    sections = summary.render(summary.DEFAULT_DIR)
    with open(summary.README) as f:
        text = f.read()
    assert summary.rewrite(text, sections) == text
    edited = text.replace("<!-- summary:measured-here -->\n", "<!-- summary:measured-here -->\n| hand | copied |\n", 1)
    assert summary.rewrite(edited, sections) != edited
