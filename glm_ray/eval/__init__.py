"""Accuracy checks against OpenAI-compatible servers (`glm-ray eval ...`)."""
