from shared.engine.attention.backend import AttentionBackend, TorchAttentionBackend
from shared.engine.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend"]
