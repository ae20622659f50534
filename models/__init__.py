"""Model code shared by learner and actors: the tiny local model and token logprobs."""
