"""Tiny Hugging Face models built from configs, their tokenizer, and the critic's value head."""
from hpcrl.models.causal_lm import (
                                    create_model_dir,
                                    load_causal_lm,
                                    log_probs_head,
                                    position_ids,
                                    response_log_probs,
                                    tiny_qwen2_config,
)
from hpcrl.models.critic import ValueModel, response_values, values_head
from hpcrl.models.tokenizer import CharTokenizer

__all__ = ["create_model_dir", "load_causal_lm", "log_probs_head", "position_ids", "response_log_probs",
           "tiny_qwen2_config", "ValueModel", "response_values", "values_head", "CharTokenizer"]
