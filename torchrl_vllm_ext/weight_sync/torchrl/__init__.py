"""Everything of weight sync that TorchRL calls, one module per way in: the scheme's
``WeightSyncScheme`` contract (:mod:`.scheme_contract`), the versions and counter every
TorchRL push goes through (:mod:`.pushes`), the service's ``RLvLLMEngine`` weight calls
(:mod:`.engine_updates`) and the scheme-and-sender shape of TorchRL's GRPO scripts
(:mod:`.script_scheme`)."""
