"""Toy data that needs no download: a character corpus, a clustered task with known experts, and
procedurally drawn shape images."""
from .clustered import ClusteredTask, make_clustered_task
from .images import SHAPE_CLASSES, make_shapes
from .text import CharCorpus, load_char_corpus

__all__ = ["CharCorpus", "load_char_corpus", "ClusteredTask", "make_clustered_task", "make_shapes", "SHAPE_CLASSES"]
