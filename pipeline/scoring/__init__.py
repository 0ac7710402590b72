"""What scoring a suite needs besides an engine: lm-eval's model, likelihoods, the code sandbox, the resume cache, bench's load generator."""
