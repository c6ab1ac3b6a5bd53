"""Finding a model's attention and seeing its calls: which modules are attention layers and how
to read their query/key weights (:mod:`.adapters`, the family registry :mod:`.registry`, the
declarative :mod:`.spec`, Hugging Face's families :mod:`.hf`), and how a probe sees a layer's
calls while a window is open (:mod:`.probes`, the call kinds :mod:`.calls`, the interception of
anyone's attention :mod:`.intercept`, hooks that survive ``torch.compile`` :mod:`.compiled`, what is
installed on a module :mod:`.installs`). :mod:`.clip` is QK-Clip's scaling of a layer's rows.
"""
