"""Draw the map of the book: papers -> chapters -> notebooks and `minimoe` modules.

    python book/_scripts/book_map.py     # writes book/_static/book-map.png

The same mapping is the table on the front page (book/intro.md); tests/test_book_references.py
checks that every notebook and module named here exists.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PAPERS = {
    "liu": "Liu et al. 2024\nRouters in Vision MoE",
    "ssr": "Nguyen et al. 2026\nSelective Sinkhorn Routing",
    "kool": "Kool et al. 2021\nUnbiased balanced assignments",
    "usmoe": "Do et al. 2025\nUSMoE, a unified perspective",
    "probmoe": "Zhao et al. 2026\nProbMoE",
    "wang": "Wang et al. 2024\nAux-loss-free balancing",
}

# chapter: (title, papers, notebooks, modules)
CHAPTERS = {
    1: ("The MoE layer and its routers", ["liu"], ["01", "02", "15"],
        ["minimoe.layers", "minimoe.routers.softmax_topk", "minimoe.routers.expert_choice", "minimoe.losses",
         "minimoe.hf"]),
    2: ("Routing as optimal transport", ["ssr", "liu"], ["03", "03b"],
        ["minimoe.ops.sinkhorn", "minimoe.ops.transport", "minimoe.routers.sinkhorn", "minimoe.routers.base_layer"]),
    3: ("Selective Sinkhorn Routing", ["ssr"], ["04", "04b"], ["minimoe.routers.ssr", "minimoe.ops.gaussian_top1"]),
    4: ("Six routers, one formulation", ["liu"], ["05", "05b"],
        ["minimoe.ops.sparse_ot", "minimoe.routers.sparse_expert_choice", "minimoe.routers.soft_moe"]),
    5: ("Sampling balanced assignments", ["kool"], ["06", "06b", "07", "07b"],
        ["minimoe.ops.gumbel_matching", "minimoe.ops.balanced_estimators", "minimoe.routers.kool"]),
    6: ("Routing as a linear program", ["usmoe"], ["08", "09"],
        ["minimoe.ops.selection", "minimoe.ops.selection_lp", "minimoe.routers.usmoe"]),
    7: ("Probabilistic routing over subsets", ["probmoe"], ["10", "10b", "11", "11b"],
        ["minimoe.ops.ksubset", "minimoe.routers.probmoe", "minimoe.routers.densemixer"]),
    8: ("Expert parallelism", ["liu", "ssr", "kool", "usmoe", "probmoe"], ["12"], ["minimoe.parallel"]),
    9: ("What the routers teach us", ["liu", "ssr", "kool", "usmoe", "probmoe"], ["13"], ["minimoe.experiments"]),
    10: ("Loss-free balancing is dual ascent", ["wang"], ["14"],
         ["minimoe.ops.bias_balancing", "minimoe.routers.loss_free", "minimoe.layers"]),
}

COLOURS = {"liu": "#4c72b0", "ssr": "#dd8452", "kool": "#55a868", "usmoe": "#c44e52", "probmoe": "#8172b3", "wang": "#937860"}


def draw(out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(13, 9.0))
    ax.set_xlim(0, 12.6)
    ax.set_ylim(-1.6, 9.6)
    ax.axis("off")
    rows = {c: 9 - c for c in CHAPTERS}                      # chapter 1 on top
    paper_rows = {p: 8.0 - 1.75 * i for i, p in enumerate(PAPERS)}
    for column, title in ((1.2, "papers"), (5.0, "chapters"), (8.2, "notebooks"), (10.9, "minimoe modules")):
        ax.text(column, 9.35, title, ha="center", fontsize=12, weight="bold")
    for paper, y in paper_rows.items():
        ax.text(1.2, y, PAPERS[paper], ha="center", va="center", fontsize=9,
                bbox=dict(boxstyle="round", fc=COLOURS[paper], alpha=0.25, ec=COLOURS[paper]))
    for chapter, (title, papers, notebooks, modules) in CHAPTERS.items():
        y = rows[chapter]
        ax.text(5.0, y, f"{chapter}. {title}", ha="center", va="center", fontsize=9.5,
                bbox=dict(boxstyle="round", fc="white", ec="0.4"))
        if len(papers) == 1 or chapter == 2:
            for paper in papers:
                ax.annotate("", xy=(3.25, y), xytext=(2.55, paper_rows[paper]),
                            arrowprops=dict(arrowstyle="->", color=COLOURS[paper], lw=1.4, alpha=0.8))
        else:  # chapters 8 and 9 draw on all five papers
            ax.text(3.0, y, "all five", ha="center", va="center", fontsize=8, style="italic", color="0.35")
        ax.text(8.2, y, ", ".join(notebooks), ha="center", va="center", fontsize=9.5, family="monospace",
                bbox=dict(fc="white", ec="none", pad=1.5))  # the connectors stop at the text
        ax.plot([6.6, 7.7], [y, y], color="0.6", lw=0.8)
        shown = [m.replace("minimoe.", "") for m in modules]
        ax.text(9.2, y, "\n".join(shown) if len(shown) <= 2 else "\n".join([", ".join(shown[:2]), ", ".join(shown[2:])]),
                ha="left", va="center", fontsize=8, family="monospace")
        ax.plot([8.7, 9.1], [y, y], color="0.6", lw=0.8)
    ax.set_title("The map of the book: which paper each chapter derives, and where it runs", fontsize=13)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    target = ROOT / "book" / "_static" / "book-map.png"
    draw(target)
    print(f"wrote {target.relative_to(ROOT)}")
