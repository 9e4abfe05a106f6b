"""DeepInfer Gateway: the serving layer around DeepSeek's DeepInfer engine."""
