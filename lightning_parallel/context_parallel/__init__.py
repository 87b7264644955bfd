"""Context parallelism: each sequence of a replica's batch split over ``context_parallel`` ranks."""
