"""Fill the book's table placeholders from the committed reference study (run once at the merge):
{{CLAIMS_TABLE <section>}} in the chapters, {{RESULTS_TABLE}}, {{CLAIMS_TABLE}} and
{{BASELINES_TABLE <task>}} in chapter 9, {{CHOOSING_TABLE}} in the choosing page. Old pasted tables
are replaced by hand (tests/test_book_numbers.py says which)."""
import re
from pathlib import Path

from minimoe.experiments import read_results, report

ROOT = Path(__file__).resolve().parents[1]
rows = read_results(ROOT / "minimoe/experiments/results/reference-cpu")
fill = {
    r"\{\{CLAIMS_TABLE (ch\d+-reference)\}\}": lambda m: report.claims_table(rows, section=m.group(1)),
    r"\{\{RESULTS_TABLE\}\}": lambda m: report.results_table(rows),
    r"\{\{CLAIMS_TABLE\}\}": lambda m: report.claims_table(rows),
    r"\{\{BASELINES_TABLE (\w+)\}\}": lambda m: report.baselines_table(rows, m.group(1)),
    r"\{\{CHOOSING_TABLE\}\}": lambda m: report.choosing_table(rows),
}
for page in sorted((ROOT / "book").glob("*.md")):
    text = page.read_text()
    new = text
    for pattern, make in fill.items():
        new = re.sub(pattern, make, new)
    if new != text:
        page.write_text(new)
        print("filled", page.name)

# ---- the numbers of chapter 9's prose that are a plain computation ({{N name}})
import json
import math
import statistics

from minimoe import routers as registry
from minimoe.experiments import claims, stats
from minimoe.experiments.configs import TASKS
from minimoe.experiments.runner import study_origin

folder = ROOT / "minimoe/experiments/results/reference-cpu"
runs = {(r["task"], r["router"], r["seed"]): r["wall_time_s"] for r in rows if r["metric"] == "ms_per_step"}
cpu_hours = sum(runs.values()) / 3600
origin = study_origin(folder)
numbers = {"cpu hours": f"{cpu_hours:.1f}", "wall hours": f"{cpu_hours / 2:.1f}",
           "commit": f"`{origin['commit'][:7]}`", "date": origin["date"],
           "lm run seconds": f"{statistics.mean(w for (t, *_), w in runs.items() if t == 'lm'):.0f}",
           "claims tests": str(len(claims.evaluate(rows)))}
short = {"lm": "lm", "clustered": "cl", "vision": "vi"}
router_rows = [r for r in rows if r["router"] in registry.available()]
for task in TASKS:
    metric, higher = claims.headline(task)
    table = stats.best_set(stats.by_seed(router_rows, task, metric), higher_is_better=higher)
    others = [r for r in table["rows"] if r != table["best"]]
    diffs = [table["rows"][r]["diff"] for r in others]
    sds = [d.half_width * math.sqrt(d.n) / stats.t_quantile(0.975, d.n - 1) for d in diffs]
    leader = stats.compare_to_best(router_rows, task, metric, higher_is_better=higher)["rows"]
    digits = 3 if task == "lm" else 4
    numbers[f"{short[task]} hw"] = f"{stats.median([d.half_width for d in diffs]):.{digits}f}"
    numbers[f"{short[task]} sd"] = f"{stats.median(sds):.{digits}f}"
    numbers[f"{short[task]} sep"] = str(sum(table["rows"][r]["separated"] for r in others))
    numbers[f"{short[task]} lead"] = str(sum(bool(leader[r].get("separated")) for r in others))
    if task == "lm":
        numbers["lm seeds needed"] = f"{(1.96 * stats.median(sds) / 0.015) ** 2:.0f}"
for name, value in numbers.items():
    print(f"{{{{N {name}}}}} = {value}")
old = {"LM_SEPARATED_BEST_SET": "lm sep", "CLUSTERED_SEPARATED_BEST_SET": "cl sep",
       "VISION_SEPARATED_BEST_SET": "vi sep", "LM_SEPARATED_LEADER": "lm lead",
       "CLUSTERED_SEPARATED_LEADER": "cl lead", "VISION_SEPARATED_LEADER": "vi lead"}
for page in [*sorted((ROOT / "book").glob("*.md")), ROOT / "README.md"]:
    text = page.read_text()
    new = re.sub(r"\{\{N ([a-z0-9 ]+)\}\}", lambda m: numbers.get(m.group(1), m.group(0)), text)
    new = re.sub(r"\{\{([A-Z_]+)\}\}", lambda m: numbers[old[m.group(1)]] if m.group(1) in old else m.group(0), new)
    new = new.replace("{{STUDY_CPU_HOURS}}", numbers["cpu hours"])
    if new != text:
        page.write_text(new)
        print("numbers filled in", page.name)
