"""What every API view shares: OpenAI's error shape (`errors`), its response shapes
(`responses`), and the one authentication of an API key (`auth`). Below the apps' views, above
the accounts it authenticates against; it imports no other app."""
