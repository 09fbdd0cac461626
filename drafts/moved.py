"""What moved since the first study: the claims' verdicts of the first study (800-step LM; its results
file from main) and of the reference study, both evaluated by today's claims code."""
import sys
from collections import Counter

from minimoe.experiments import claims, read_results

old = {(r["claim"].claim, r["task"]): r for r in claims.evaluate(read_results(sys.argv[1]))}
new = {(r["claim"].claim, r["task"]): r for r in claims.evaluate(read_results(sys.argv[2]))}
moves = Counter()
for key, row in new.items():
    before = old.get(key, {}).get("verdict", "-")
    moves[before, row["verdict"]] += 1
    mark = "" if before == row["verdict"] else "  <-- moved"
    print(f"{key[0][:70]:70s} {key[1]:9s} {before:9s} -> {row['verdict']:9s} {claims.effect_text(row)}{mark}")
print(dict(moves))
print("old:", Counter(r["verdict"] for r in old.values()), "new:", Counter(r["verdict"] for r in new.values()))
