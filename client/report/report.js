// The page's own script: builds the charts from the JSON blob, then records
// in <pre id="render-check"> what it drew (non-blank pixels, data points and
// line styles per canvas, the table's width against the page's, and any
// script errors) so that a headless browser's dumped DOM shows whether the
// report really renders.
(function () {
  const chartIds = ['chart-loss', 'chart-loss-time', 'chart-grad-norm',
                    'chart-throughput', 'chart-memory'];
  const charts = {};
  const palette = ['#1f77b4', '#d62728', '#2ca02c', '#ff7f0e', '#9467bd',
                   '#8c564b', '#e377c2', '#7f7f7f'];
  // Bars are coloured by rank, so not in the strategies' colours.
  const rankPalette = ['#6baed6', '#08519c', '#9ecae1', '#3182bd',
                       '#c6dbef', '#2171b5', '#deebf7', '#4292c6'];
  // One chart failing (or chart.js missing) must not stop the others or the
  // render check; the error is recorded instead.
  function guarded(fn) {
    try { fn(); } catch (e) { window.reportErrors.push(String(e)); }
  }
  // Strategies that trained the same draw the same curve: each gets its own
  // dash pattern and width, the first widest and drawn first, each later
  // one narrower and on top (Chart.js draws the lowest `order` last), so
  // every one shows: the wider below around the narrower, and through its
  // dashes' gaps.
  const dashes = [[], [10, 6], [3, 4], [14, 4, 3, 4], [6, 3], [2, 2]];
  function lineStyle(i) {
    return {borderDash: dashes[i % dashes.length],
            borderWidth: Math.max(1.5, 5 - 1.5 * i), order: -i,
            pointStyle: 'line'};
  }
  // Validation losses are markers, not lines: a shape of its own per
  // strategy, the first largest and drawn first, so that coinciding
  // evaluations stay visible around each other, and no marker's swatch
  // looks like a training curve's.
  const markers = ['circle', 'triangle', 'rect', 'rectRot', 'star',
                   'crossRot'];
  function markerStyle(i) {
    return {pointStyle: markers[i % markers.length],
            pointRadius: Math.max(3, 8 - 2 * i), showLine: false,
            borderWidth: 2, order: -i};
  }
  // Legend swatches in each dataset's own style: short lines in a training
  // curve's width and dashes, a validation series' marker; the legend keeps
  // the strategies' order, not the drawing order.
  const legend = {
    labels: {usePointStyle: true, pointStyleWidth: 36,
             sort: function (a, b) { return a.datasetIndex - b.datasetIndex; }},
  };
  function faint(colour) { return colour + '40'; }  // 25% opaque
  let data = {strategies: []};
  guarded(function () {
    data = JSON.parse(document.getElementById('report-data').textContent);
  });

  // x: 'step' or 'elapsed' (seconds of training, rank 0).
  function lineChart(id, title, yTitle, field, extra, x) {
    x = x || 'step';
    const datasets = [];
    data.strategies.forEach(function (s, i) {
      const colour = palette[i % palette.length];
      datasets.push(Object.assign({
        label: s.label,
        data: s.steps.map(function (p) { return {x: p[x], y: p[field]}; }),
        borderColor: colour, backgroundColor: colour, pointRadius: 0,
      }, lineStyle(i)));
      if (!extra) return;
      const points = s.steps.filter(function (p) { return extra in p; })
          .map(function (p) { return {x: p[x], y: p[extra]}; });
      if (points.length === 0) return;
      datasets.push(Object.assign({
        label: s.label + ' (val)', data: points,
        borderColor: colour, backgroundColor: faint(colour),
      }, markerStyle(i)));
    });
    charts[id] = new Chart(document.getElementById(id), {
      type: 'line',
      data: {datasets: datasets},
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        plugins: {title: {display: true, text: title}, legend: legend},
        scales: {
          x: {type: 'linear', title: {display: true,
              text: x === 'step' ? 'step' : 'training time (s)'}},
          y: {title: {display: true, text: yTitle}},
        },
      },
    });
  }

  // Throughput: each step's figure faint, and its mean over the last five
  // steps (the first, warm-up step left out when there are more).
  function throughputChart() {
    const datasets = [];
    data.strategies.forEach(function (s, i) {
      const colour = palette[i % palette.length];
      const steps = s.steps.length > 1 ? s.steps.slice(1) : s.steps;
      datasets.push({
        label: s.label + ' (each step)',
        data: steps.map(function (p) {
          return {x: p.step, y: p.tokens_per_second};
        }),
        showLine: false, pointRadius: 2, order: -i,
        borderColor: faint(colour), backgroundColor: faint(colour),
      });
      const span = 5;
      datasets.push(Object.assign({
        label: s.label + ' (mean of ' + span + ')',
        data: steps.map(function (p, k) {
          const from = Math.max(0, k - span + 1);
          let sum = 0;
          for (let j = from; j <= k; ++j) sum += steps[j].tokens_per_second;
          return {x: p.step, y: sum / (k - from + 1)};
        }),
        borderColor: colour, backgroundColor: colour, pointRadius: 0,
      }, lineStyle(i)));
    });
    charts['chart-throughput'] =
        new Chart(document.getElementById('chart-throughput'), {
          type: 'line',
          data: {datasets: datasets},
          options: {
            animation: false, responsive: true, maintainAspectRatio: false,
            plugins: {title: {display: true, text: 'Throughput (all ranks)'},
                      legend: legend},
            scales: {
              x: {type: 'linear', title: {display: true, text: 'step'}},
              y: {title: {display: true, text: 'tokens/s'}},
            },
          },
        });
  }

  function memoryChart() {
    let maxRanks = 0;
    data.strategies.forEach(function (s) {
      maxRanks = Math.max(maxRanks, s.peak_memory.length);
    });
    const datasets = [];
    for (let r = 0; r < maxRanks; ++r) {
      datasets.push({
        label: 'rank ' + r,
        data: data.strategies.map(function (s) {
          const entry =
              s.peak_memory.find(function (e) { return e.rank === r; });
          return entry ? entry.bytes / (1024 * 1024) : null;
        }),
        backgroundColor: rankPalette[r % rankPalette.length],
      });
    }
    charts['chart-memory'] =
        new Chart(document.getElementById('chart-memory'), {
          type: 'bar',
          data: {
            labels: data.strategies.map(function (s) { return s.label; }),
            datasets: datasets,
          },
          options: {
            animation: false, responsive: true, maintainAspectRatio: false,
            plugins: {title: {display: true, text: 'Peak memory per rank'}},
            scales: {
              y: {beginAtZero: true, title: {display: true, text: 'MiB'}},
            },
          },
        });
  }

  guarded(function () {
    lineChart('chart-loss', 'Loss by step (rank 0)', 'loss', 'loss',
              'val_loss');
  });
  guarded(function () {
    lineChart('chart-loss-time', 'Loss by training time (rank 0)', 'loss',
              'loss', 'val_loss', 'elapsed');
  });
  guarded(function () {
    lineChart('chart-grad-norm', 'Gradient norm (before clipping)',
              'grad norm', 'grad_norm');
  });
  guarded(throughputChart);
  guarded(memoryChart);

  function recordRender() {
    const result = {canvases: {}, errors: window.reportErrors};
    guarded(function () {
      result.table_width = document.querySelector('table').scrollWidth;
      result.page_width = document.body.clientWidth;
    });
    chartIds.forEach(function (id) {
      const entry = {painted_pixels: 0, data_points: 0, styles: [],
                     colour_pixels: {}};
      result.canvases[id] = entry;
      guarded(function () {
        const canvas = document.getElementById(id);
        const pixels = canvas.getContext('2d')
            .getImageData(0, 0, canvas.width, canvas.height).data;
        for (let i = 3; i < pixels.length; i += 4) {
          if (pixels[i] !== 0) ++entry.painted_pixels;
        }
        // How many pixels of the plot area (the legend's swatches left out)
        // show each strategy's colour, nearly opaque: a curve hidden under
        // another has none.
        const chart = charts[id];
        if (!chart || id === 'chart-memory') return;
        const area = chart.chartArea;
        const ratio = canvas.width / canvas.clientWidth;
        const x0 = Math.floor(area.left * ratio);
        const x1 = Math.ceil(area.right * ratio);
        const y0 = Math.floor(area.top * ratio);
        const y1 = Math.ceil(area.bottom * ratio);
        data.strategies.forEach(function (s, k) {
          const hex = palette[k % palette.length];
          const rgb = [1, 3, 5].map(function (o) {
            return parseInt(hex.substr(o, 2), 16);
          });
          let count = 0;
          for (let y = y0; y < y1; ++y) {
            for (let x = x0; x < x1; ++x) {
              const p = 4 * (y * canvas.width + x);
              if (pixels[p + 3] > 200 &&
                  Math.abs(pixels[p] - rgb[0]) < 24 &&
                  Math.abs(pixels[p + 1] - rgb[1]) < 24 &&
                  Math.abs(pixels[p + 2] - rgb[2]) < 24) {
                ++count;
              }
            }
          }
          entry.colour_pixels[s.label] = count;
        });
      });
      if (!charts[id]) return;
      charts[id].data.datasets.forEach(function (d) {
        d.data.forEach(function (v) { if (v !== null) ++entry.data_points; });
        entry.styles.push({label: d.label, width: d.borderWidth,
                           dash: (d.borderDash || []).join(','),
                           point: d.pointStyle || '',
                           line: d.showLine !== false});
      });
    });
    document.getElementById('render-check').textContent =
        JSON.stringify(result);
  }
  requestAnimationFrame(function () { setTimeout(recordRender, 0); });
})();
