"""A job's output checks on the worker side (contract 1.3): the schemas refused at intake, each attempt's
checker, and what the status record keeps for consumers and ``sluice audit``.

Rule: a job whose tool or answer schema the validator cannot take is bad input, refused at intake like an
unknown route (``failed`` / ``invalid_request``, one line naming the tool and the reason, dead-lettered);
the worker never crashes on a schema. Each attempt runs under its route's ``invalid_output`` policy unless the
job sets its own; the attempt's ``stream.start`` says which. The status record keeps the declarations
(``checks``, the text ``sluice audit`` recomputes the verdicts from), the validator and its version, how many
calls were invalid and the answer's verdict.
"""

from __future__ import annotations

from sluice.normalizer.checks import Checker, SchemaProblem, schema_problem, validator_version
from sluice.schemas.checks import checks_for, encode_checks
from sluice.schemas.jobs import Job
from sluice.schemas.result import Result
from sluice.worker.config import Route
from sluice.worker.pipeline.context import Deps

__all__ = ["attempt_checks", "intake_problem", "status_fields"]


def intake_problem(deps: Deps, job: Job) -> str | None:
    """Why the job's schemas cannot be checked (one line), or None; compiles them into the worker's cache."""
    return schema_problem(checks_for(job.request), deps.validators)


def attempt_checks(deps: Deps, job: Job, route: Route) -> Checker | str | None:
    """The attempt's checker (None: the job declares nothing to check), or why its schemas cannot be
    compiled (intake refuses such jobs: only a validator changed under a job already admitted gets here)."""
    spec = checks_for(job.request)
    if spec is None:
        return None
    try:
        return Checker.compile(spec, job.invalid_output or route.invalid_output, deps.validators)
    except SchemaProblem as exc:
        return str(exc)


def status_fields(job: Job | None, result: Result) -> dict[str, str]:
    """The status record's output-check fields; none for a job that declares nothing to check."""
    spec = checks_for(job.request) if job is not None else None
    if spec is None:
        return {}
    fields = {"checks": encode_checks(spec).decode(), "validator": validator_version()}
    if result.invalid_calls is not None:
        fields["invalid_calls"] = str(result.invalid_calls)
    if result.answer is not None:
        fields["answer_check"] = "valid" if result.answer.valid else "invalid"
    return fields
