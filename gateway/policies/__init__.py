"""Flow control's policies, each chosen by name in the config and reading read-only views only (gateway/flow/views.py):
fairness, ordering, saturation, holdback (usage limit) and its adaptive reserve, victims and their cost, the
endpoint picker, KV admission."""
