"""Episodes: a policy's responses to prompts, sampled with the run's engine, scored by the run's reward sources and
reduced to per-response numbers; the one road that training and every evaluation take (`lmppo.episodes.road`)."""
