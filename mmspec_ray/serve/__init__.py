"""mmspec_ray.serve"""
