"""Graph passes: a captured GraphModule and a Plan in, per-rank GraphModules out."""
