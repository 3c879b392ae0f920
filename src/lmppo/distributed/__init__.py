"""How training is spread over processes: the strategy the loop calls, and DeepSpeed ZeRO support."""
