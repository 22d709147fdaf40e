"""The client edge: the kvloom.v1.Generation service, request validation,
tokenizing, and turning engine outputs into response streams."""
