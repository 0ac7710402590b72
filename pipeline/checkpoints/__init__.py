"""Checkpoint normalisation: any supported source -> a plain Hugging Face safetensors directory."""


def auto_model_class(config):
    """The transformers Auto class that builds this config's model: image-text-to-text for VLMs
    (Glm4v and kin), causal LM otherwise."""
    import transformers

    if type(config) in transformers.AutoModelForImageTextToText._model_mapping:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM
