"""Generation: a model, a batch of prompts, tokens drawn on the device (sampler.py; sample.py's engine)."""
