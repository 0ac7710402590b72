"""The published shapes the GPU benchmarks build their random-weight models at, written once: GLM-4-9B (GlmForCausalLM),
GLM-4.6V-Flash (Glm4vForConditionalGeneration) and GLM-4.6V (Glm4vMoeForConditionalGeneration). Data only."""

# GLM-4-9B (THUDM/glm-4-9b-chat-hf, GlmForCausalLM): 40 layers of 4096, 32 query / 2 KV heads, MLP 13696
GLM4_9B = dict(
    vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_attention_heads=32,
    num_key_value_heads=2, head_dim=128, partial_rotary_factor=0.5, max_position_embeddings=131072,
    rms_norm_eps=1.5625e-07, attention_bias=True, rope_theta=5000000.0, pad_token_id=151329,
    eos_token_id=[151329, 151336, 151338], tie_word_embeddings=False,
)


# GLM-4.6V-Flash (zai-org/GLM-4.6V-Flash, Glm4vForConditionalGeneration): the published config's text tower (GLM-4-9B's
# widths: 40 layers of 4096, 32 query / 2 KV heads, MLP 13696; 3-D rotary over half of each head, theta 500000,
# a 128k window) and its 24-block vision tower (1536 wide, MLP 13696, 14-pixel patches, 2 x 2 merge into 4096).
GLM46V_FLASH_TEXT = dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                         num_attention_heads=32, num_key_value_heads=2, max_position_embeddings=131072,
                         rms_norm_eps=1e-05, attention_bias=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5,
                                          "mrope_section": [8, 12, 12]})
GLM46V_FLASH_VISION = dict(depth=24, hidden_size=1536, num_heads=12, intermediate_size=13696, out_hidden_size=4096,
                           patch_size=14, image_size=336, spatial_merge_size=2, temporal_patch_size=2)
# GLM-4.6V (zai-org/GLM-4.6V, Glm4vMoeForConditionalGeneration; transformers' Glm4vMoeConfig defaults agree on the
# widths): 46 text layers of 4096, the first dense (MLP 10944), the rest 128 routed experts of 1408 (top 8) plus
# one shared expert behind a sigmoid router; 96 query / 8 KV heads of 128; a 24-block vision tower (MLP 10944).
GLM46V_MOE_TEXT = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                       num_attention_heads=96, num_key_value_heads=8, head_dim=128, moe_intermediate_size=1408,
                       n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                       topk_group=1, max_position_embeddings=131072, rms_norm_eps=1e-05, attention_bias=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5,
                                        "mrope_section": [8, 12, 12]})
GLM46V_MOE_VISION = dict(depth=24, hidden_size=1536, num_heads=12, intermediate_size=10944, out_hidden_size=4096,
                         patch_size=14, image_size=336, spatial_merge_size=2, temporal_patch_size=2)
