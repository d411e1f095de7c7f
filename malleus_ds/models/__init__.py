from .llama import (EMBED, HEAD, PRESETS, Block, Embedding, Head, ModelConfig, StageModule,
                    build_layer, build_model, lm_loss, model_config)

__all__ = ["EMBED", "HEAD", "PRESETS", "Block", "Embedding", "Head", "ModelConfig", "StageModule",
           "build_layer", "build_model", "lm_loss", "model_config"]
