"""Operations routes: liveness, readiness (DB and Redis) and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from batch_api.auth import ContextDep
from batch_api.context import ApiContext
from batch_api.errors import ServiceUnavailable
from batch_api.openapi import NOT_READY

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="The process is alive")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", summary="The database and Redis answer", responses=NOT_READY)
async def readyz(context: ContextDep) -> JSONResponse:
    checks = await run_in_threadpool(_check_dependencies, context)
    failing = {name: result for name, result in checks.items() if result != "ok"}
    if not failing:
        return JSONResponse({"status": "ready", "checks": checks})
    error = ServiceUnavailable(
        "Not ready: " + "; ".join(f"{name} unreachable ({result})" for name, result in failing.items()),
        headers={"retry-after": "5"},
    )
    return JSONResponse({**error.envelope(), "checks": checks}, status_code=error.status, headers=error.headers)


@router.get(
    "/metrics", summary="Prometheus metrics", response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format."}},
)
def metrics(context: ContextDep) -> Response:
    return Response(generate_latest(context.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _check_dependencies(context: ApiContext) -> dict[str, str]:
    checks: dict[str, str] = {}
    try:
        with context.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready; the reason is reported
        checks["database"] = _reason(exc)
    try:
        if context.redis is None:
            raise ConnectionError("not connected")
        context.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:  # noqa: BLE001
        checks["redis"] = _reason(exc)
    return checks


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}".rstrip(": ")
