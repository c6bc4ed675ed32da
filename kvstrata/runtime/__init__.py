"""Runtime: requests, the scheduler (continuous batching), the model runner, the sampler, the offline Engine."""
