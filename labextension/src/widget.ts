/**
 * GraphModel / GraphView: a graphviz SVG in a pan/zoom box.
 *
 * Synced traits (see slapo_lab/editor/graph_widget.py):
 * - `svg`: the graphviz SVG string; sanitised here before it is shown;
 * - `selected`: the token (graphviz node `id`) of the highlighted node, or '';
 * - `height`: CSS height of the box (default '420px');
 * - `reset_view`: a counter; each change resets pan/zoom to "fit";
 * - `render_id`: the id of the drawing in `svg` (the kernel bumps it with
 *   every new SVG; node tokens are positional, so a click names its drawing);
 * - `highlighted`: tokens of the highlighted nodes (search matches): class
 *   `slapo-highlighted` on them (and in the minimap), the other nodes dimmed;
 * - `centre` / `centre_request`: each change of the counter centres the view on
 *   the node `centre` (zooming in first if its text would be unreadably small).
 *
 * Zoom state: the view keeps its pan/zoom transform when `svg` changes (a
 * recolouring after a primitive call should not move the picture); it goes
 * back to the identity (the home view: the whole drawing, or its top at a
 * readable scale) when `reset_view` changes.
 *
 * Navigation (Netron / Model Explorer): drag pans. The wheel and a trackpad's
 * two-finger scroll pan (deltaX and deltaY; Shift turns a vertical wheel into a
 * horizontal pan) only while the graph has focus (a click in it, or Tab; the
 * box gets `slapo-focused`); over an unfocused graph the event is left alone so
 * the notebook scrolls (a hint says how to pan). Ctrl/Cmd+wheel and a pinch
 * (delivered as a wheel event with ctrlKey) zoom about the pointer by
 * exp(-deltaY * ZOOM_PER_PX), clamped per event and to SCALE_EXTENT. The "Fit"
 * button fits the whole drawing (its getBBox) into the visible box. Drawings of
 * more than MINIMAP_NODES nodes get a minimap: a small copy of the drawing with
 * the visible part framed; a click or drag in it moves the view there.
 *
 * Messages to the kernel (custom messages):
 *   {event: 'click', node: token, render: id} and {event: 'dblclick', node: token, render: id},
 * where token is the `id` of the clicked `<g class="node">` and id the
 * `render_id` the shown SVG arrived with (the kernel ignores clicks on an older
 * drawing). A double click also produces the two clicks before it, as in the DOM.
 * Keyboard shortcuts, context menus and the command palette (editor.ts) send
 *   {event: 'action', action: name, node?: token, render?: id}
 * and the answer to an open_panel request is {event: 'panel', opened: bool, reason?: text}.
 *
 * Messages from the kernel: {cmd: 'open_panel', model_id: id} asks the front end
 * to show widget `model_id` in a main-area panel (handled once per model, by the
 * handler editor.ts installs with setPanelHandler).
 *
 * Context menus: `action_reasons` (action -> '' or the reason it does not apply),
 * `action_labels` (action -> label) and `action_target` (the module they describe).
 */
import { DOMWidgetModel, DOMWidgetView, ISerializers } from '@jupyter-widgets/base';
import { select, Selection } from 'd3-selection';
import { zoom, zoomIdentity, ZoomBehavior, ZoomTransform } from 'd3-zoom';

import { nodeTooltip, sanitizeSvg, stripNativeTooltips } from './sanitize';
import { MODULE_NAME, MODULE_VERSION } from './version';

const SELECTED_CLASS = 'slapo-selected';
const HIGHLIGHT_CLASS = 'slapo-highlighted';
/** Zoom per CSS px of wheel deltaY for Ctrl+wheel / pinch: a 100-px notch is exp(0.15) = 1.16x. */
const ZOOM_PER_PX = 0.0015;
/** One wheel event never zooms by more than this factor (or less than its inverse). */
const MAX_STEP_ZOOM = 1.5;
/** Zoom transform scale limits, relative to the home view. */
const SCALE_EXTENT: [number, number] = [0.02, 40];
/** Drawings with more nodes than this get a minimap (graph_widget.py MINIMAP_NODES). */
const MINIMAP_NODES = 40;
/** The minimap's largest width / height in CSS px. */
const MINIMAP_MAX_W = 180;
const MINIMAP_MAX_H = 140;
/** Margin (CSS px) left around the drawing by "Fit". */
const FIT_MARGIN_PX = 8;
/**
 * The smallest scale (CSS px per SVG user unit = point) the fit uses: 12-pt node names stay at
 * least 9 px and 10-pt badges 7.5 px. A drawing that would need less is shown from its top at this
 * scale (or fitted to the width, if that is larger) and the user pans; the wheel still zooms out.
 */
const MIN_FIT_SCALE = 0.75;
const SVG_NS = 'http://www.w3.org/2000/svg';

/** The drawing's own viewBox and how many CSS px one user unit is at 1:1. */
interface INaturalGeometry {
  x: number;
  y: number;
  w: number;
  h: number;
  pxPerUnit: number;
}

const UNIT_PX: { [unit: string]: number } = { '': 1, px: 1, pt: 4 / 3, pc: 16, in: 96, cm: 96 / 2.54, mm: 96 / 25.4 };

function lengthPx(value: string | null): number {
  const m = /^\s*([0-9.eE+-]+)\s*([a-z]*)\s*$/.exec(value || '');
  if (!m || !(m[2] in UNIT_PX)) {
    return NaN;
  }
  return parseFloat(m[1]) * UNIT_PX[m[2]];
}

/** Read viewBox / width / height of a graphviz root (graphviz: width="123pt", viewBox="0 0 123 45"). */
function naturalGeometry(svg: SVGSVGElement): INaturalGeometry | null {
  const widthPx = lengthPx(svg.getAttribute('width'));
  const heightPx = lengthPx(svg.getAttribute('height'));
  const vb = (svg.getAttribute('viewBox') || '').trim().split(/[\s,]+/).map(Number);
  if (vb.length === 4 && vb.every(Number.isFinite) && vb[2] > 0 && vb[3] > 0) {
    const pxPerUnit = widthPx > 0 ? widthPx / vb[2] : 1;
    return { x: vb[0], y: vb[1], w: vb[2], h: vb[3], pxPerUnit };
  }
  if (widthPx > 0 && heightPx > 0) {
    return { x: 0, y: 0, w: widthPx, h: heightPx, pxPerUnit: 1 };
  }
  return null;
}

/** Every GraphView on the page (editor.ts finds the view of an editor element here). */
export const liveViews = new Set<GraphView>();

/** Opens widget `modelId` in a panel; installed by the JupyterLab plugin (editor.ts). */
export type PanelHandler = (graph: GraphModel, modelId: string) => Promise<void>;
/** Opens the context menu of `token` (a node, or null for the selected module) at (x, y). */
export type MenuHandler = (view: GraphView, token: string | null, x: number, y: number) => void;

let panelHandler: PanelHandler | null = null;
let menuHandler: MenuHandler | null = null;

export function setPanelHandler(handler: PanelHandler | null): void {
  panelHandler = handler;
}

export function setMenuHandler(handler: MenuHandler | null): void {
  menuHandler = handler;
}

/** A direction for keyboard navigation of the graph. */
export type Direction = 'left' | 'right' | 'up' | 'down';

export class GraphModel extends DOMWidgetModel {
  initialize(...args: Parameters<DOMWidgetModel['initialize']>): void {
    super.initialize(...args);
    this.on('msg:custom', this._onKernelMsg, this);
  }

  /** Send one action message (keyboard, context menu, palette) to the kernel. */
  sendAction(action: string, node?: string | null, render?: number): void {
    const msg: { [key: string]: string | number } = { event: 'action', action };
    if (node) {
      msg.node = node;
      msg.render = typeof render === 'number' ? render : Number(this.get('render_id')) || 0;
    }
    this.send(msg, {});
  }

  private _onKernelMsg(content: unknown): void {
    const msg = content as { cmd?: unknown; model_id?: unknown } | null;
    if (!msg || msg.cmd !== 'open_panel') {
      return;
    }
    const id = msg.model_id;
    if (typeof id !== 'string' || !id) {
      this.send({ event: 'panel', opened: false, reason: 'The open_panel request named no widget.' }, {});
      return;
    }
    if (!panelHandler) {
      this.send(
        {
          event: 'panel',
          opened: false,
          reason: 'This front end cannot open panels (the slapo-lab JupyterLab plugin is not active here).'
        },
        {}
      );
      return;
    }
    panelHandler(this, id).catch(err => {
      console.error('slapo-lab: could not open the editor panel', err);
      this.send({ event: 'panel', opened: false, reason: `The panel could not be opened: ${String(err)}.` }, {});
    });
  }

  defaults(): Record<string, unknown> {
    return {
      ...super.defaults(),
      _model_name: GraphModel.model_name,
      _model_module: GraphModel.model_module,
      _model_module_version: GraphModel.model_module_version,
      _view_name: GraphModel.view_name,
      _view_module: GraphModel.view_module,
      _view_module_version: GraphModel.view_module_version,
      svg: '',
      selected: '',
      height: '420px',
      reset_view: 0,
      render_id: 0,
      highlighted: [],
      centre: '',
      centre_request: 0,
      action_reasons: {},
      action_labels: {},
      action_target: ''
    };
  }

  static serializers: ISerializers = {
    ...DOMWidgetModel.serializers
  };

  static model_name = 'GraphModel';
  static model_module = MODULE_NAME;
  static model_module_version = MODULE_VERSION;
  static view_name = 'GraphView';
  static view_module = MODULE_NAME;
  static view_module_version = MODULE_VERSION;
}

export class GraphView extends DOMWidgetView {
  private _box!: HTMLDivElement;
  private _canvas!: HTMLDivElement;
  private _tooltip!: HTMLDivElement;
  private _message!: HTMLDivElement;
  private _svg: SVGSVGElement | null = null;
  private _zoom: ZoomBehavior<SVGSVGElement, unknown> | null = null;
  private _transform: ZoomTransform = zoomIdentity;
  private _tips = new WeakMap<Element, string>();
  private _natural: INaturalGeometry | null = null;
  private _resizeObserver: ResizeObserver | null = null;
  /** `render_id` of the SVG on screen (sent back with every click). */
  private _renderId = 0;
  private _layer: SVGGElement | null = null;
  private _hint!: HTMLDivElement;
  private _hintTimer = 0;
  private _kernel: any = null;
  private _minimap!: HTMLDivElement;
  private _miniSvg: SVGSVGElement | null = null;
  private _miniView: SVGRectElement | null = null;
  /** The drawing's box in layer coordinates (getBBox of the zoom layer, else the natural viewBox). */
  private _drawing: { x: number; y: number; w: number; h: number } | null = null;
  /** The nodes of the drawing and their minimap copies, in the same order. */
  private _nodes: Element[] = [];
  private _miniNodes: Element[] = [];
  /** A centre request that arrived before the drawing could be measured. */
  private _pendingCentre = false;
  /** The node the keyboard is on (usually the selected one; also input/output nodes). */
  private _cursor = '';
  /** Pan the next selection into view (set by a keyboard move). */
  private _revealNext = false;

  render(): void {
    // this.el belongs to ipywidgets (its `layout` styles are applied to it, and
    // an unset layout.height clears el.style.height), so the sized box is an
    // inner element.
    this.el.classList.add('slapo-graph');
    this._box = document.createElement('div');
    this._box.className = 'slapo-graph-box';
    // focusable, so that a click (or Tab) gives the graph the wheel; see _onWheel
    this._box.tabIndex = 0;
    this._box.setAttribute('role', 'group');
    this._box.setAttribute(
      'aria-label',
      'Model graph: drag or (when focused) scroll to pan, Ctrl+scroll or pinch to zoom'
    );
    this.el.appendChild(this._box);

    this._canvas = document.createElement('div');
    this._canvas.className = 'slapo-graph-canvas';
    this._box.appendChild(this._canvas);

    this._message = document.createElement('div');
    this._message.className = 'slapo-graph-message';
    this._box.appendChild(this._message);

    const fit = document.createElement('button');
    fit.className = 'slapo-graph-fit jp-Button';
    fit.type = 'button';
    fit.title = 'Fit the whole drawing into the view';
    fit.textContent = 'Fit';
    fit.addEventListener('click', () => this.fitAll());
    this._box.appendChild(fit);

    this._minimap = document.createElement('div');
    this._minimap.className = 'slapo-graph-minimap';
    this._minimap.title = 'Minimap: click or drag to move the view';
    this._minimap.style.display = 'none';
    this._minimap.addEventListener('pointerdown', this._onMiniDown);
    this._box.appendChild(this._minimap);

    this._hint = document.createElement('div');
    this._hint.className = 'slapo-graph-hint';
    this._hint.textContent = 'Click the graph to pan with the wheel · Ctrl+wheel or pinch zooms';
    this._hint.style.display = 'none';
    this._box.appendChild(this._hint);

    this._tooltip = document.createElement('div');
    this._tooltip.className = 'slapo-graph-tooltip';
    this._tooltip.style.display = 'none';
    this._box.appendChild(this._tooltip);

    this._canvas.addEventListener('click', this._onClick);
    this._canvas.addEventListener('dblclick', this._onDblClick);
    this._canvas.addEventListener('mouseover', this._onOver);
    this._canvas.addEventListener('mousemove', this._onMove);
    this._canvas.addEventListener('mouseout', this._onOut);
    this._canvas.addEventListener('mouseleave', this._hideTooltip);
    this._canvas.addEventListener('contextmenu', this._onContextMenu);
    // capture: d3-zoom stops the mousedown's propagation, focus must still move here
    this._box.addEventListener('pointerdown', this._onPointerDown, true);
    this._box.addEventListener('wheel', this._onWheel, { passive: false });
    this._box.addEventListener('focus', this._onFocusChange);
    this._box.addEventListener('blur', this._onFocusChange);

    // Every view of the model (the cell's and the panel's) listens to the same change events, and Backbone
    // calls them one after another without a try: one view that throws would leave the others showing an old
    // drawing. Each listener is therefore guarded, and a failure is logged and shown in this view only.
    this.listenTo(this.model, 'change:svg', this._guard('draw the graph', this._renderSvg));
    this.listenTo(this.model, 'change:selected', this._guard('show the selection', this._applySelection));
    this.listenTo(this.model, 'change:height', this._guard('set the height', this._applyHeight));
    this.listenTo(this.model, 'change:reset_view', this._guard('reset the view', this.resetView));
    this.listenTo(this.model, 'change:highlighted', this._guard('highlight', this._applyHighlight));
    this.listenTo(this.model, 'change:centre_request', this._guard('centre', this._requestCentre));

    if (typeof ResizeObserver !== 'undefined') {
      this._resizeObserver = new ResizeObserver(
        this._guard('fit the resized view', () => {
          this._fitViewBox();
          this._measure();
          this._updateMinimap();
          if (this._pendingCentre) {
            this._centreNow();
          }
        })
      );
      this._resizeObserver.observe(this._canvas);
    }

    this._applyHeight();
    this._renderSvg();
    liveViews.add(this);
    this._watchKernel();
  }

  /**
   * A kernel that died or restarted leaves this editor without its Python half: clicks would go nowhere.
   * Say so on the editor (one sentence, the controls greyed out) instead of looking alive.
   */
  private _watchKernel(): void {
    const manager: any = (this.model as any).widget_manager;
    const kernel = manager && manager.kernel;
    if (kernel && kernel.statusChanged) {
      this._kernel = kernel;
      kernel.statusChanged.connect(this._onKernelStatus, this);
    }
    this.listenTo(this.model, 'comm_live_update', () => {
      if (!(this.model as any).comm_live) {
        this._markGone('The kernel connection of this editor closed');
      }
    });
  }

  private _onKernelStatus(_kernel: any, status: string): void {
    if (status === 'dead') {
      this._markGone('The kernel has stopped');
    } else if (status === 'restarting' || status === 'autorestarting') {
      this._markGone('The kernel restarted');
    }
  }

  private _markGone(what: string): void {
    const host = this.editorElement() || this._box;
    if (!host || host.classList.contains('slapo-kernel-gone')) {
      return;
    }
    host.classList.add('slapo-kernel-gone');
    const note = document.createElement('div');
    note.className = 'slapo-kernel-gone-note';
    note.setAttribute('role', 'alert');
    note.textContent =
      `${what}: this editor no longer answers clicks. Run its cell again after restarting the kernel ` +
      '(with schedule_file= the recorded schedule comes back).';
    host.prepend(note);
  }

  remove(): void {
    liveViews.delete(this);
    if (this._kernel) {
      this._kernel.statusChanged.disconnect(this._onKernelStatus, this);
      this._kernel = null;
    }
    this._hideTooltip();
    window.clearTimeout(this._hintTimer);
    this._box.removeEventListener('wheel', this._onWheel);
    this._endMiniDrag();
    this._resizeObserver?.disconnect();
    this._resizeObserver = null;
    if (this._svg) {
      select(this._svg).on('.zoom', null);
    }
    return super.remove();
  }

  /** The editor element (class slapo-editor) this view is part of, if any. */
  editorElement(): HTMLElement | null {
    return this.el.closest('.slapo-editor');
  }

  /** The `render_id` of the drawing on screen. */
  get renderId(): number {
    return this._renderId;
  }

  /** The node the keyboard is on: the cursor if it is drawn, else the selected node, else ''. */
  currentToken(): string {
    if (this._cursor && this._findNode(this._cursor)) {
      return this._cursor;
    }
    const sel: string = this.model.get('selected') || '';
    return sel && this._findNode(sel) ? sel : '';
  }

  /** Send an action about `node` (default: none, the kernel uses its selection) for this drawing. */
  sendAction(action: string, node?: string | null): void {
    (this.model as GraphModel).sendAction(action, node || null, this._renderId);
  }

  /**
   * Move the keyboard cursor to the neighbouring node in direction `dir` (by position on screen:
   * the nearest node in that half-plane, sideways distance counting double) and select it. With
   * no cursor yet, the first node of the drawing. Returns the new token, or '' if there is none.
   */
  moveCursor(dir: Direction): string {
    if (!this._nodes.length) {
      return '';
    }
    const from = this.currentToken();
    let target: Element | null = null;
    if (!from) {
      target = this._nodes[0];
    } else {
      const here = this._findNode(from)!.getBoundingClientRect();
      const cx = here.left + here.width / 2;
      const cy = here.top + here.height / 2;
      let best = Infinity;
      for (const node of this._nodes) {
        if (node.id === from || !node.id) {
          continue;
        }
        const r = node.getBoundingClientRect();
        const dx = r.left + r.width / 2 - cx;
        const dy = r.top + r.height / 2 - cy;
        const along = dir === 'left' ? -dx : dir === 'right' ? dx : dir === 'up' ? -dy : dy;
        const side = dir === 'left' || dir === 'right' ? Math.abs(dy) : Math.abs(dx);
        if (along <= 2) {
          continue;
        }
        const score = along + 2 * side;
        if (score < best) {
          best = score;
          target = node;
        }
      }
    }
    if (!target) {
      return '';
    }
    this._setCursor(target.id);
    this._revealNext = true;
    this._reveal(target);
    this.sendAction('select', target.id);
    return target.id;
  }

  /** Focus the graph box (keyboard navigation starts there). */
  focusGraph(): void {
    this._box.focus({ preventScroll: true });
  }

  private _setCursor(token: string): void {
    this._cursor = token;
    this._nodes.forEach(n => n.classList.toggle('slapo-cursor', !!token && n.id === token));
  }

  /** Pan so that `node` is inside the visible box (a margin of 24 px), keeping the zoom. */
  private _reveal(node: Element): void {
    const box = this._canvas.getBoundingClientRect();
    const r = node.getBoundingClientRect();
    const m = 24;
    let dx = 0;
    let dy = 0;
    if (r.left < box.left + m) {
      dx = box.left + m - r.left;
    } else if (r.right > box.right - m) {
      dx = box.right - m - r.right;
    }
    if (r.top < box.top + m) {
      dy = box.top + m - r.top;
    } else if (r.bottom > box.bottom - m) {
      dy = box.bottom - m - r.bottom;
    }
    this._panByScreen(dx, dy);
  }

  private _onContextMenu = (event: MouseEvent): void => {
    const node = this._nodeOf(event);
    if (!node || !menuHandler || event.shiftKey) {
      return; // elsewhere: JupyterLab's own menu (with "Open schedule editor in a panel"); Shift: the browser's
    }
    event.preventDefault();
    event.stopPropagation();
    this._box.focus({ preventScroll: true });
    this._setCursor(node.id);
    menuHandler(this, node.id, event.clientX, event.clientY);
  };

  /** Back to the identity transform: the home view (see _fitViewBox). */
  resetView(): void {
    this._transform = zoomIdentity;
    if (this._svg && this._zoom) {
      select(this._svg).call(this._zoom.transform, zoomIdentity);
    }
  }

  /** "Fit": the transform that shows the whole drawing, centred, inside the visible box. */
  fitAll(): void {
    const vis = this._visible();
    const d = this._drawing;
    if (!vis || !d || d.w <= 0 || d.h <= 0) {
      this.resetView();
      return;
    }
    const margin = FIT_MARGIN_PX / vis.pxPerUnit;
    let k = Math.min((vis.w - 2 * margin) / d.w, (vis.h - 2 * margin) / d.h);
    // never enlarge beyond the natural size (a three-node graph is not blown up)
    if (this._natural) {
      k = Math.min(k, this._natural.pxPerUnit / vis.pxPerUnit);
    }
    k = Math.max(SCALE_EXTENT[0], Math.min(SCALE_EXTENT[1], k));
    const x = vis.x + (vis.w - k * d.w) / 2 - k * d.x;
    const y = vis.y + (vis.h - k * d.h) / 2 - k * d.y;
    this._setTransform(zoomIdentity.translate(x, y).scale(k));
  }

  private _setTransform(t: ZoomTransform): void {
    if (this._svg && this._zoom) {
      select(this._svg).call(this._zoom.transform, t);
    }
  }

  /**
   * The part of the root SVG's user space the box shows ({x, y, w, h}) and the CSS px per user
   * unit; null while the box has no size. With preserveAspectRatio "meet" this can be larger
   * than the viewBox, so it is measured from the screen matrix.
   */
  private _visible(): { x: number; y: number; w: number; h: number; pxPerUnit: number } | null {
    const svg = this._svg;
    if (!svg) {
      return null;
    }
    const ctm = svg.getScreenCTM();
    const rect = svg.getBoundingClientRect();
    if (!ctm || !(ctm.a > 0) || rect.width <= 0 || rect.height <= 0) {
      return null;
    }
    return {
      x: (rect.left - ctm.e) / ctm.a,
      y: (rect.top - ctm.f) / ctm.d,
      w: rect.width / ctm.a,
      h: rect.height / ctm.d,
      pxPerUnit: ctm.a
    };
  }

  /** Pan by (dx, dy) CSS px on screen: the drawing moves by that much. */
  private _panByScreen(dx: number, dy: number): void {
    const vis = this._visible();
    if (!vis || (!dx && !dy)) {
      return;
    }
    const t = this._transform;
    this._setTransform(zoomIdentity.translate(t.x + dx / vis.pxPerUnit, t.y + dy / vis.pxPerUnit).scale(t.k));
  }

  /** The drawing's box in layer coordinates, from getBBox (needs layout); else the natural geometry. */
  private _measure(): void {
    const layer = this._layer;
    if (!layer) {
      this._drawing = null;
      return;
    }
    let box: { x: number; y: number; w: number; h: number } | null = null;
    try {
      const b = layer.getBBox();
      if (b.width > 0 && b.height > 0) {
        box = { x: b.x, y: b.y, w: b.width, h: b.height };
      }
    } catch {
      box = null; // not rendered yet (display: none): keep the natural geometry
    }
    if (!box && this._natural) {
      const n = this._natural;
      box = { x: n.x, y: n.y, w: n.w, h: n.h };
    }
    this._drawing = box;
  }

  private _hasFocus(): boolean {
    const active = document.activeElement;
    return !!active && this._box.contains(active);
  }

  private _onFocusChange = (): void => {
    this._box.classList.toggle('slapo-focused', this._hasFocus());
    if (this._hasFocus()) {
      this._showHint(false);
    }
  };

  private _onPointerDown = (event: PointerEvent): void => {
    const target = event.target as Element | null;
    if (target && typeof target.closest === 'function' && target.closest('button')) {
      return; // the Fit button takes the focus itself
    }
    if (!this._hasFocus()) {
      this._box.focus({ preventScroll: true });
    }
  };

  /**
   * Wheel: Ctrl/Cmd (a pinch sets ctrlKey) zooms about the pointer at a bounded rate, whether the
   * graph has focus or not (the browser would otherwise zoom the whole page); a plain wheel or
   * two-finger scroll pans only while the graph has focus, and otherwise is left to the notebook.
   */
  private _onWheel = (event: WheelEvent): void => {
    if (!this._svg || !this._zoom) {
      return;
    }
    const unit = event.deltaMode === 1 ? 16 : event.deltaMode === 2 ? this._canvas.clientHeight || 400 : 1;
    let dx = event.deltaX * unit;
    let dy = event.deltaY * unit;
    if (event.ctrlKey || event.metaKey) {
      event.preventDefault();
      const factor = Math.min(MAX_STEP_ZOOM, Math.max(1 / MAX_STEP_ZOOM, Math.exp(-dy * ZOOM_PER_PX)));
      const ctm = this._svg.getScreenCTM();
      if (!ctm) {
        return;
      }
      // the pointer in root user units: the point under it stays put
      const px = (event.clientX - ctm.e) / ctm.a;
      const py = (event.clientY - ctm.f) / ctm.d;
      const t = this._transform;
      const k = Math.max(SCALE_EXTENT[0], Math.min(SCALE_EXTENT[1], t.k * factor));
      const r = k / t.k;
      this._setTransform(zoomIdentity.translate(px - (px - t.x) * r, py - (py - t.y) * r).scale(k));
      return;
    }
    if (!this._hasFocus()) {
      this._showHint(true);
      return; // no preventDefault: the notebook scrolls
    }
    event.preventDefault();
    if (event.shiftKey && !dx) {
      dx = dy;
      dy = 0;
    }
    this._panByScreen(-dx, -dy);
  };

  private _showHint(show: boolean): void {
    window.clearTimeout(this._hintTimer);
    this._hint.style.display = show ? '' : 'none';
    if (show) {
      this._hintTimer = window.setTimeout(() => this._showHint(false), 1500);
    }
  }

  /** `fn` bound to this view, its exceptions logged and shown in this view instead of thrown to the caller. */
  private _guard(what: string, fn: (...args: any[]) => void): (...args: any[]) => void {
    return (...args: any[]) => {
      try {
        fn.apply(this, args);
      } catch (err) {
        console.error(`slapo-lab: the graph view could not ${what}`, err);
        this._showMessage(`The graph view could not ${what}: ${String(err)}.`);
      }
    };
  }

  private _applyHeight(): void {
    const h = this.model.get('height');
    this._box.style.height = typeof h === 'string' && h ? h : '420px';
  }

  private _renderSvg(): void {
    this._hideTooltip();
    const text: string = this.model.get('svg') || '';
    const rid = Number(this.model.get('render_id'));
    this._renderId = Number.isInteger(rid) ? rid : 0;
    if (this._svg) {
      select(this._svg).on('.zoom', null);
    }
    this._canvas.replaceChildren();
    this._svg = null;
    this._zoom = null;
    this._layer = null;
    this._drawing = null;
    this._nodes = [];
    this._buildMinimap(null);

    if (!text.trim()) {
      this._showMessage('(no graph)');
      return;
    }
    let svg: SVGSVGElement | null = null;
    try {
      svg = sanitizeSvg(text);
    } catch (err) {
      console.error('slapo-lab: could not parse the graph SVG', err);
    }
    if (!svg) {
      this._showMessage('The graph could not be displayed: the SVG is malformed or empty after sanitising.');
      return;
    }
    this._showMessage('');

    // Tooltips: remember each node's text, then drop the native ones.
    this._tips = new WeakMap<Element, string>();
    svg.querySelectorAll('g.node').forEach(node => {
      const tip = nodeTooltip(node);
      if (tip) {
        this._tips.set(node, tip);
      }
    });
    stripNativeTooltips(svg);
    this._nodes = Array.from(svg.querySelectorAll('g.node'));
    const mini = this._nodes.length > MINIMAP_NODES ? (svg.cloneNode(true) as SVGSVGElement) : null;

    // Fit: the drawing is scaled into the box by the viewBox (never above its
    // natural size, so a three-node graph is not blown up); the zoom transform
    // is applied to one wrapper group around the whole drawing.
    this._natural = naturalGeometry(svg);
    svg.removeAttribute('width');
    svg.removeAttribute('height');
    svg.setAttribute('preserveAspectRatio', 'xMidYMid meet');
    svg.classList.add('slapo-graph-svg');

    const layer = document.createElementNS(SVG_NS, 'g') as SVGGElement;
    layer.setAttribute('class', 'slapo-zoom-layer');
    while (svg.firstChild) {
      layer.appendChild(svg.firstChild);
    }
    svg.appendChild(layer);
    this._canvas.appendChild(svg);
    this._svg = svg;
    this._layer = layer;
    this._fitViewBox();
    this._measure();
    this._buildMinimap(mini);

    const behaviour = zoom<SVGSVGElement, unknown>()
      .scaleExtent(SCALE_EXTENT)
      .on('zoom', event => {
        this._transform = event.transform as ZoomTransform;
        layer.setAttribute('transform', this._transform.toString());
        this._hideTooltip();
        this._updateMinimap();
      });
    const sel: Selection<SVGSVGElement, unknown, null, undefined> = select(svg);
    // d3's own wheel zoom is replaced by _onWheel (pan when focused, bounded Ctrl/pinch zoom)
    sel.call(behaviour).on('dblclick.zoom', null).on('wheel.zoom', null);
    this._zoom = behaviour;
    // Keep the previous pan/zoom across re-renders.
    sel.call(behaviour.transform, this._transform);

    this._applySelection();
    this._applyHighlight();
    if (this._pendingCentre) {
      this._centreNow();
    }
  }

  // ---------------------------------------------------------------- minimap

  /**
   * Show `copy` (a clone of the sanitised drawing, or null for none) as the minimap: ids, text and
   * the node/edge classes are dropped (no duplicate tokens, no hover styles), the graphviz
   * transform kept; its viewBox is the drawing's box in layer coordinates, so a point in it is a
   * point of the layer. The frame `_miniView` shows the visible part.
   */
  private _buildMinimap(copy: SVGSVGElement | null): void {
    this._endMiniDrag();
    this._minimap.replaceChildren();
    this._miniSvg = null;
    this._miniView = null;
    this._miniNodes = [];
    if (!copy || !this._drawing) {
      this._minimap.style.display = 'none';
      return;
    }
    copy.querySelectorAll('text, title').forEach(e => e.remove());
    this._miniNodes = Array.from(copy.querySelectorAll('g.node'));
    copy.querySelectorAll('[id]').forEach(e => e.removeAttribute('id'));
    copy.querySelectorAll('g.node, g.edge, g.cluster').forEach(g => {
      const cls = g.getAttribute('class') || '';
      g.setAttribute('class', cls.replace(/\b(node|edge|cluster)\b/g, 'slapo-mini-$1'));
    });
    copy.removeAttribute('id');
    copy.removeAttribute('width');
    copy.removeAttribute('height');
    copy.setAttribute('class', 'slapo-minimap-svg');
    copy.setAttribute('preserveAspectRatio', 'xMidYMid meet');
    copy.setAttribute('aria-hidden', 'true');
    const d = this._drawing;
    copy.setAttribute('viewBox', `${d.x} ${d.y} ${d.w} ${d.h}`);
    const scale = Math.min(MINIMAP_MAX_W / d.w, MINIMAP_MAX_H / d.h);
    this._minimap.style.width = `${Math.max(24, Math.round(d.w * scale))}px`;
    this._minimap.style.height = `${Math.max(24, Math.round(d.h * scale))}px`;
    const view = document.createElementNS(SVG_NS, 'rect') as SVGRectElement;
    view.setAttribute('class', 'slapo-minimap-view');
    view.setAttribute('vector-effect', 'non-scaling-stroke');
    copy.appendChild(view);
    this._minimap.appendChild(copy);
    this._minimap.style.display = '';
    this._miniSvg = copy;
    this._miniView = view;
  }

  /** Move the minimap's frame to the visible part of the drawing (layer coordinates). */
  private _updateMinimap(): void {
    const view = this._miniView;
    const vis = this._visible();
    if (!view || !vis) {
      return;
    }
    const t = this._transform;
    const d = this._drawing;
    let x0 = (vis.x - t.x) / t.k;
    let y0 = (vis.y - t.y) / t.k;
    let x1 = x0 + vis.w / t.k;
    let y1 = y0 + vis.h / t.k;
    if (d) {
      // the frame is clipped to the drawing (a box wider than the drawing would leave only a band)
      const clip = (a: number, lo: number, hi: number) => Math.min(hi, Math.max(lo, a));
      [x0, x1] = [clip(x0, d.x, d.x + d.w), clip(x1, d.x, d.x + d.w)];
      [y0, y1] = [clip(y0, d.y, d.y + d.h), clip(y1, d.y, d.y + d.h)];
    }
    view.setAttribute('x', String(x0));
    view.setAttribute('y', String(y0));
    view.setAttribute('width', String(Math.max(0, x1 - x0)));
    view.setAttribute('height', String(Math.max(0, y1 - y0)));
  }

  /** Centre the view on the layer point under a minimap pointer event (keeps the zoom). */
  private _moveToMini(event: PointerEvent): void {
    const mini = this._miniSvg;
    const vis = this._visible();
    const ctm = mini?.getScreenCTM();
    if (!mini || !vis || !ctm || !(ctm.a > 0)) {
      return;
    }
    const px = (event.clientX - ctm.e) / ctm.a;
    const py = (event.clientY - ctm.f) / ctm.d;
    const k = this._transform.k;
    this._setTransform(zoomIdentity.translate(vis.x + vis.w / 2 - k * px, vis.y + vis.h / 2 - k * py).scale(k));
  }

  private _onMiniDown = (event: PointerEvent): void => {
    if (event.button !== 0 || !this._miniSvg) {
      return;
    }
    event.preventDefault();
    event.stopPropagation();
    this._box.focus({ preventScroll: true });
    this._moveToMini(event);
    window.addEventListener('pointermove', this._onMiniMove, true);
    window.addEventListener('pointerup', this._endMiniDrag, true);
  };

  private _onMiniMove = (event: PointerEvent): void => {
    event.preventDefault();
    this._moveToMini(event);
  };

  private _endMiniDrag = (): void => {
    window.removeEventListener('pointermove', this._onMiniMove, true);
    window.removeEventListener('pointerup', this._endMiniDrag, true);
  };

  // ---------------------------------------------------------------- highlight and centre

  private _applyHighlight(): void {
    if (!this._svg) {
      return;
    }
    const tokens = new Set<string>((this.model.get('highlighted') as string[] | null) || []);
    let any = false;
    this._nodes.forEach((node, i) => {
      const on = tokens.has(node.id);
      any = any || on;
      node.classList.toggle(HIGHLIGHT_CLASS, on);
      this._miniNodes[i]?.classList.toggle(HIGHLIGHT_CLASS, on);
    });
    this._svg.classList.toggle('slapo-has-highlight', any);
    this._miniSvg?.classList.toggle('slapo-has-highlight', any);
  }

  private _requestCentre(): void {
    this._pendingCentre = true;
    this._centreNow();
  }

  /**
   * Centre the node `centre` in the visible box: zoom in first (about the box's centre) if its
   * text would be smaller than MIN_FIT_SCALE px per point, then pan. Waits (keeps the request)
   * while there is no drawing or the box has no size.
   */
  private _centreNow(): void {
    const token: string = this.model.get('centre') || '';
    if (!token) {
      this._pendingCentre = false;
      return;
    }
    const node = this._findNode(token);
    const layer = this._layer;
    if (!node || !layer || !this._visible()) {
      return; // try again after the next render / resize
    }
    this._pendingCentre = false;
    const layerCtm = layer.getScreenCTM();
    const nat = this._natural;
    if (layerCtm && nat && layerCtm.a / nat.pxPerUnit < MIN_FIT_SCALE) {
      const vis = this._visible()!;
      const t = this._transform;
      const k = Math.min(SCALE_EXTENT[1], (t.k * MIN_FIT_SCALE * nat.pxPerUnit) / layerCtm.a);
      const cx = vis.x + vis.w / 2;
      const cy = vis.y + vis.h / 2;
      const r = k / t.k;
      this._setTransform(zoomIdentity.translate(cx - (cx - t.x) * r, cy - (cy - t.y) * r).scale(k));
    }
    const box = this._canvas.getBoundingClientRect();
    const n = node.getBoundingClientRect();
    this._panByScreen(box.left + box.width / 2 - (n.left + n.width / 2), box.top + box.height / 2 - (n.top + n.height / 2));
  }

  /**
   * Set the viewBox so that the drawing fits the box, centred, at most at its
   * natural size and at least at MIN_FIT_SCALE (a bigger drawing is shown from
   * its top-left; pan to see the rest). Called on render and whenever the box is
   * resized; a no-op while the box has no size (not attached yet). The scale is
   * left in the SVG's `data-fit-scale` attribute (tests read it).
   */
  private _fitViewBox(): void {
    const svg = this._svg;
    const nat = this._natural;
    if (!svg || !nat) {
      return;
    }
    const width = this._canvas.clientWidth;
    const height = this._canvas.clientHeight;
    if (width <= 0 || height <= 0) {
      if (!svg.getAttribute('viewBox')) {
        svg.setAttribute('viewBox', `${nat.x} ${nat.y} ${nat.w} ${nat.h}`);
      }
      return;
    }
    // px per user unit: the whole drawing, centred, never above its natural size ...
    let scale = Math.min(width / nat.w, height / nat.h, nat.pxPerUnit);
    let fromTop = false;
    if (scale < MIN_FIT_SCALE) {
      // ... unless its text would be unreadably small: then the top of it, as wide as fits
      scale = Math.min(Math.max(MIN_FIT_SCALE, width / nat.w), nat.pxPerUnit);
      fromTop = true;
    }
    const vw = width / scale;
    const vh = height / scale;
    const vx = fromTop && vw < nat.w ? nat.x : nat.x + nat.w / 2 - vw / 2;
    const vy = fromTop ? nat.y : nat.y + nat.h / 2 - vh / 2;
    svg.setAttribute('viewBox', `${vx} ${vy} ${vw} ${vh}`);
    svg.dataset.fitScale = scale.toFixed(3);
  }

  private _showMessage(text: string): void {
    this._message.textContent = text;
    this._message.style.display = text ? '' : 'none';
  }

  private _applySelection(): void {
    if (!this._svg) {
      return;
    }
    const selected: string = this.model.get('selected') || '';
    this._svg.querySelectorAll(`g.node.${SELECTED_CLASS}`).forEach(n => n.classList.remove(SELECTED_CLASS));
    if (selected) {
      const node = this._findNode(selected);
      if (node) {
        node.classList.add(SELECTED_CLASS);
        this._setCursor(selected);
        if (this._revealNext) {
          this._reveal(node);
        }
      }
    }
    this._revealNext = false;
  }

  private _findNode(token: string): Element | null {
    if (!this._svg) {
      return null;
    }
    for (const node of Array.from(this._svg.querySelectorAll('g.node'))) {
      if (node.id === token) {
        return node;
      }
    }
    return null;
  }

  /** The graphviz node group an event happened in, if any. */
  private _nodeOf(event: Event): Element | null {
    const target = event.target as Element | null;
    if (!target || typeof target.closest !== 'function') {
      return null;
    }
    const node = target.closest('g.node');
    return node && this._canvas.contains(node) && node.id ? node : null;
  }

  private _onClick = (event: MouseEvent): void => {
    event.preventDefault();
    const node = this._nodeOf(event);
    if (node) {
      this.send({ event: 'click', node: node.id, render: this._renderId });
    }
  };

  private _onDblClick = (event: MouseEvent): void => {
    event.preventDefault();
    const node = this._nodeOf(event);
    if (node) {
      this.send({ event: 'dblclick', node: node.id, render: this._renderId });
    }
  };

  private _onOver = (event: MouseEvent): void => {
    const node = this._nodeOf(event);
    const tip = node ? this._tips.get(node) : undefined;
    if (!tip) {
      this._hideTooltip();
      return;
    }
    this._tooltip.textContent = tip;
    this._tooltip.style.display = 'block';
    this._placeTooltip(event);
  };

  private _onMove = (event: MouseEvent): void => {
    if (this._tooltip.style.display !== 'none') {
      this._placeTooltip(event);
    }
  };

  private _onOut = (event: MouseEvent): void => {
    const from = this._nodeOf(event);
    const to = (event.relatedTarget as Element | null)?.closest?.('g.node') ?? null;
    if (from && from !== to) {
      this._hideTooltip();
    }
  };

  private _hideTooltip = (): void => {
    if (this._tooltip) {
      this._tooltip.style.display = 'none';
    }
  };

  private _placeTooltip(event: MouseEvent): void {
    const box = this._box.getBoundingClientRect();
    const tip = this._tooltip;
    let x = event.clientX - box.left + 14;
    let y = event.clientY - box.top + 14;
    const w = tip.offsetWidth;
    const h = tip.offsetHeight;
    if (x + w > box.width - 4) {
      x = Math.max(4, event.clientX - box.left - w - 10);
    }
    if (y + h > box.height - 4) {
      y = Math.max(4, event.clientY - box.top - h - 10);
    }
    tip.style.left = `${x}px`;
    tip.style.top = `${y}px`;
  }
}
