"""Benchmarks: workloads, roofline probe, engine and transformers runs, reports (`infer bench`)."""
