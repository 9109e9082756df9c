"""Task verbs. Every permit and counter change of the task lifecycle lives in
this package; views, the worker consumer and commands only call these."""
