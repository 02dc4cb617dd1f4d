"""``Annotated`` dependency aliases for route handlers; the objects live on ``app.state`` (made in lifespan)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from livelora.gateway.api.logprobs import TokenTexts
from livelora.gateway.api.serving import Admission
from livelora.gateway.engines.base import Engine
from livelora.gateway.settings import GatewaySettings


def get_engine(request: Request) -> Engine:
    return request.app.state.engine


def get_settings(request: Request) -> GatewaySettings:
    return request.app.state.settings


def get_admission(request: Request) -> Admission:
    return request.app.state.admission


def get_token_texts(request: Request) -> TokenTexts:
    return request.app.state.token_texts


EngineDep = Annotated[Engine, Depends(get_engine)]
SettingsDep = Annotated[GatewaySettings, Depends(get_settings)]
AdmissionDep = Annotated[Admission, Depends(get_admission)]
TokenTextsDep = Annotated[TokenTexts, Depends(get_token_texts)]
