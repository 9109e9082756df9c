"""A task's dependency graph as the task page draws it: inline SVG rendered
on the server (templates/admin/tasks/task/dependency_graph.html), no script.
The task in the middle, its dependencies on the left and its dependents on
the right, one level each way, at most GRAPH_NODES drawn a side and a
"+N more" node for the rest. Every text reaches the page through the
template's escaping; nothing here is marked safe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from console.data import GRAPH_NODES, Linked, LinkedPage

NODE_WIDTH = 220
NODE_HEIGHT = 38
ROW = 46  # a node and the gap below it
COLUMN_GAP = 110
MARGIN = 10
# Characters of a handler that fit a node after the short id (12 px monospace).
HANDLER_CHARACTERS = 17

# (fill, stroke) per state: a light fill under dark text, the state's colour
# round it (the dashboard's bars use the strokes' colours).
STATE_STYLES: dict[str, tuple[str, str]] = {
    "BLOCKED": ("#e1d5e7", "#9673a6"),
    "WAITING": ("#dae8fc", "#6c8ebf"),
    "LEASED": ("#fff2cc", "#d6b656"),
    "RUNNING": ("#d5e8d4", "#82b366"),
    "NEEDS_REVIEW": ("#ffe6cc", "#d79b00"),
    "SUCCEEDED": ("#b9e0a5", "#3d7a2a"),
    "FAILED": ("#f8cecc", "#b85450"),
    "CANCELLED": ("#eeeeee", "#888888"),
}
GONE_STYLE = ("#ffffff", "#999999")
MORE_STYLE = ("#f6f8fa", "#bbbbbb")

Kind = Literal["self", "parent", "child", "more", "gone"]


@dataclass(frozen=True)
class Node:
    kind: Kind
    x: int
    y: int
    task_id: str
    # The node's two lines: the task's short id and handler, then its state.
    title: str
    state: str
    fill: str
    stroke: str
    # Empty: drawn without a link (a pruned task has no page).
    href: str
    tooltip: str

    @property
    def width(self) -> int:
        return NODE_WIDTH

    @property
    def height(self) -> int:
        return NODE_HEIGHT

    @property
    def text_x(self) -> int:
        return self.x + 10

    @property
    def title_y(self) -> int:
        return self.y + 16

    @property
    def state_y(self) -> int:
        return self.y + 31


@dataclass(frozen=True)
class Edge:
    # SVG path data: numbers only.
    path: str
    settled: bool


@dataclass(frozen=True)
class Graph:
    width: int
    height: int
    nodes: list[Node]
    edges: list[Edge]
    parents_total: int
    children_total: int
    children_capped: bool


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _node(kind: Kind, x: int, y: int, linked: Linked, href_of: dict[str, str]) -> Node:
    if linked.state is None:
        fill, stroke = GONE_STYLE
        return Node("gone", x, y, linked.task_id, linked.task_id[:8] + "…", "gone", fill, stroke, "", linked.task_id)
    fill, stroke = STATE_STYLES.get(linked.state, GONE_STYLE)
    title = f"{linked.task_id[:8]}… {_short(linked.handler, HANDLER_CHARACTERS)}"
    tooltip = f"{linked.task_id} {linked.handler} ({linked.state})"
    return Node(kind, x, y, linked.task_id, title, linked.state, fill, stroke, href_of[linked.task_id], tooltip)


def _more(x: int, y: int, hidden: int, capped: bool, href: str) -> Node:
    fill, stroke = MORE_STYLE
    text = f"+{hidden:,}{'+' if capped else ''} more"
    return Node("more", x, y, "", text, "in the table below", fill, stroke, href, text)


def _column(total: int, drawn: int) -> int:
    """Rows a side takes: its drawn nodes and, for the rest, one more."""
    return drawn + (1 if total > drawn else 0)


def _curve(x1: int, y1: int, x2: int, y2: int) -> str:
    middle = (x1 + x2) // 2
    return f"M {x1} {y1} C {middle} {y1}, {middle} {y2}, {x2} {y2}"


def task_graph(
    task: Linked,
    parents: list[Linked],
    dependencies: LinkedPage,
    children: list[Linked],
    dependents: LinkedPage,
    href_of: dict[str, str],
) -> Graph:
    """The graph of `task`: `parents` and `children` are the first
    GRAPH_NODES of each side (the pages' totals say how many more);
    `href_of` maps each task id drawn to its page."""
    parents, children = parents[:GRAPH_NODES], children[:GRAPH_NODES]
    left_rows = _column(dependencies.count, len(parents))
    right_rows = _column(dependents.count, len(children))
    rows = max(left_rows, right_rows, 1)
    height = rows * ROW - (ROW - NODE_HEIGHT) + 2 * MARGIN
    left_x, middle_x = MARGIN, MARGIN + NODE_WIDTH + COLUMN_GAP
    right_x = middle_x + NODE_WIDTH + COLUMN_GAP
    width = right_x + NODE_WIDTH + MARGIN

    def top(index: int, count: int) -> int:
        # A side's nodes are centred on the task's row.
        return (height - (count * ROW - (ROW - NODE_HEIGHT))) // 2 + index * ROW

    centre = _node("self", middle_x, top(0, 1), task, href_of)
    centre_y = centre.y + NODE_HEIGHT // 2
    nodes = [centre]
    edges = []
    for index, parent in enumerate(parents):
        node = _node("parent", left_x, top(index, left_rows), parent, href_of)
        nodes.append(node)
        edges.append(Edge(_curve(left_x + NODE_WIDTH, node.y + NODE_HEIGHT // 2, middle_x, centre_y), parent.settled))
    if left_rows > len(parents):
        hidden = dependencies.count - len(parents)
        node = _more(left_x, top(len(parents), left_rows), hidden, False, "#task-dependencies")
        nodes.append(node)
        edges.append(Edge(_curve(left_x + NODE_WIDTH, node.y + NODE_HEIGHT // 2, middle_x, centre_y), False))
    for index, child in enumerate(children):
        node = _node("child", right_x, top(index, right_rows), child, href_of)
        nodes.append(node)
        edges.append(Edge(_curve(middle_x + NODE_WIDTH, centre_y, right_x, node.y + NODE_HEIGHT // 2), child.settled))
    if right_rows > len(children):
        hidden = dependents.count - len(children)
        node = _more(right_x, top(len(children), right_rows), hidden, dependents.capped, "#task-dependents")
        nodes.append(node)
        edges.append(Edge(_curve(middle_x + NODE_WIDTH, centre_y, right_x, node.y + NODE_HEIGHT // 2), False))
    return Graph(
        width=width,
        height=height,
        nodes=nodes,
        edges=edges,
        parents_total=dependencies.count,
        children_total=dependents.count,
        children_capped=dependents.capped,
    )
