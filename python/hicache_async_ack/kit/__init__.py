"""The SGLang adapter kit every sync is built on (torch imported only where needed):
features and states, the owner template, decisions, groups, collectives, hooks."""
