"""The engine's grammar side as the metrics scrape reads it (stats() only)."""

from types import SimpleNamespace

from controlplane.engine.grammar_gate import GrammarStats

NO_GRAMMAR = SimpleNamespace(stats=GrammarStats)
