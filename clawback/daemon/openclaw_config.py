"""The part of OpenClaw's config that `clawback openclaw install` writes (`openclaw config patch`),
in OpenClaw's own keys."""

from __future__ import annotations

from typing import TypedDict


class ModelCost(TypedDict):
    input: float
    output: float
    cacheRead: float
    cacheWrite: float


class ProviderModel(TypedDict):
    id: str
    name: str
    reasoning: bool
    input: list[str]
    cost: ModelCost
    contextWindow: int
    maxTokens: int


class Provider(TypedDict):
    baseUrl: str
    api: str
    apiKey: str
    models: list[ProviderModel]


class PluginConfig(TypedDict, total=False):
    daemonUrl: str
    apiKeyFile: str


class PluginHooks(TypedDict):
    allowConversationAccess: bool


class PluginEntry(TypedDict):
    enabled: bool
    hooks: PluginHooks
    config: PluginConfig


class Plugins(TypedDict):
    entries: dict[str, PluginEntry]


class Providers(TypedDict):
    providers: dict[str, Provider]


class PrimaryModel(TypedDict):
    primary: str


class AgentDefaults(TypedDict, total=False):
    model: PrimaryModel
    skills: list[str]
    bootstrapMaxChars: int
    bootstrapTotalMaxChars: int


class Agents(TypedDict):
    defaults: AgentDefaults


class ToolPolicy(TypedDict):
    deny: list[str]


class ConfigPatch(TypedDict, total=False):
    plugins: Plugins
    models: Providers
    tools: ToolPolicy
    agents: Agents
