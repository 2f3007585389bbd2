"""Stream processing: the pure accounting core (router, join, attribution, pricing) and the Faust app that moves data through it."""
