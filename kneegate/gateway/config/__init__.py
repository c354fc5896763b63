"""The gateway's configuration: the YAML file's models, validated once and frozen
(`gateway`: the whole file; `sections`: its small sections; `upstream`: the engines'),
reading a file (`read`) and watching it for changes (`watch`). Imports nothing of the
gateway but its errors."""
