/**
 * GraphModel / GraphView: a graphviz SVG in a pan/zoom box.
 *
 * Synced traits (see slapo_lab/editor/graph_widget.py):
 * - `svg`: the graphviz SVG string; sanitised here before it is shown;
 * - `selected`: the token (graphviz node `id`) of the highlighted node, or '';
 * - `height`: CSS height of the box (default '420px');
 * - `reset_view`: a counter; each change resets pan/zoom to "fit";
 * - `render_id`: the id of the drawing in `svg` (the kernel bumps it with
 *   every new SVG; node tokens are positional, so a click names its drawing).
 *
 * Zoom state: the view keeps its pan/zoom transform when `svg` changes (a
 * recolouring after a primitive call should not move the picture); it goes
 * back to the identity ("fit the whole graph") when `reset_view` changes or
 * when the user presses the fit button. Mouse: drag pans, wheel zooms.
 *
 * Messages to the kernel (custom messages):
 *   {event: 'click', node: token, render: id} and {event: 'dblclick', node: token, render: id},
 * where token is the `id` of the clicked `<g class="node">` and id the
 * `render_id` the shown SVG arrived with (the kernel ignores clicks on an older
 * drawing). A double click also produces the two clicks before it, as in the DOM.
 */
import { DOMWidgetModel, DOMWidgetView, ISerializers } from '@jupyter-widgets/base';
import { select, Selection } from 'd3-selection';
import { zoom, zoomIdentity, ZoomBehavior, ZoomTransform } from 'd3-zoom';

import { nodeTooltip, sanitizeSvg, stripNativeTooltips } from './sanitize';
import { MODULE_NAME, MODULE_VERSION } from './version';

const SELECTED_CLASS = 'slapo-selected';
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

export class GraphModel extends DOMWidgetModel {
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
      render_id: 0
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

  render(): void {
    // this.el belongs to ipywidgets (its `layout` styles are applied to it, and
    // an unset layout.height clears el.style.height), so the sized box is an
    // inner element.
    this.el.classList.add('slapo-graph');
    this._box = document.createElement('div');
    this._box.className = 'slapo-graph-box';
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
    fit.title = 'Fit the whole graph (reset pan and zoom)';
    fit.textContent = 'Fit';
    fit.addEventListener('click', () => this.resetView());
    this._box.appendChild(fit);

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

    this.listenTo(this.model, 'change:svg', this._renderSvg);
    this.listenTo(this.model, 'change:selected', this._applySelection);
    this.listenTo(this.model, 'change:height', this._applyHeight);
    this.listenTo(this.model, 'change:reset_view', this.resetView);

    if (typeof ResizeObserver !== 'undefined') {
      this._resizeObserver = new ResizeObserver(() => this._fitViewBox());
      this._resizeObserver.observe(this._canvas);
    }

    this._applyHeight();
    this._renderSvg();
  }

  remove(): void {
    this._hideTooltip();
    this._resizeObserver?.disconnect();
    this._resizeObserver = null;
    if (this._svg) {
      select(this._svg).on('.zoom', null);
    }
    return super.remove();
  }

  /** Back to the identity transform: the whole graph fitted in the box. */
  resetView(): void {
    this._transform = zoomIdentity;
    if (this._svg && this._zoom) {
      select(this._svg).call(this._zoom.transform, zoomIdentity);
    }
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
    this._fitViewBox();

    const behaviour = zoom<SVGSVGElement, unknown>()
      .scaleExtent([0.05, 40])
      .on('zoom', event => {
        this._transform = event.transform as ZoomTransform;
        layer.setAttribute('transform', this._transform.toString());
        this._hideTooltip();
      });
    const sel: Selection<SVGSVGElement, unknown, null, undefined> = select(svg);
    sel.call(behaviour).on('dblclick.zoom', null);
    this._zoom = behaviour;
    // Keep the previous pan/zoom across re-renders.
    sel.call(behaviour.transform, this._transform);

    this._applySelection();
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
      }
    }
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
