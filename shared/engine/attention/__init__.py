from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.attention.backend import AttentionBackend, TorchAttentionBackend

__all__ = ["AttentionMetadata", "AttentionBackend", "TorchAttentionBackend"]
