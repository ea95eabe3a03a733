"""Plans: the step vocabulary, builders' context, passes and the symbolic verifier."""
