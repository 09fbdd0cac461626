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
