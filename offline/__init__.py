"""Offline tools above the engine: training the shipped model, its corpus, evaluation, calibration, the test-model
maker and synthetic K/V. Nothing served imports them."""
